"""Tensor (and sequence) parallelism: one rank's step traced on PyTorch's fake process group, checked against
PyTorch's own DTensor code run for real.

- In one process, on the fake process group with real CPU tensors (``tp_rank``): the rank's parameter,
  gradient and optimizer bytes, the bytes autograd saves, the first step's peak and a later step's, and
  every collective DTensor issues (op, phase, payload), all to the byte, at sizes and degrees hypothesis
  draws (the degree too: the formulas are in ``tp``), for both reference models and both plans, one
  key/value head a rank included.
- On real gloo processes: tensor parallelism alone (world size 2, the loss against one process to 1e-5
  relative), and FSDP2 x tensor parallelism (world size 4, slow).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch
from hypothesis import given
from hypothesis import strategies as st
from parallel_cases import Batch, Build, adamw, reduce_scatter_peak, released_collective_buffers, spawn_gloo

import symacct
from symacct.errors import SymacctError
from symacct.measure.parallel import tp_rank, verify_parallel
from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.models.llama import Llama, LlamaConfig
from symacct.parallel.layout import make_layout
from symacct.parallel.rank import derive_parallel
from symacct.symbols import sym


def _gpt2(H: int, hd: int, V: int, L: int, S_max: int = 64) -> GPT2Config:
    return GPT2Config(n_layer=L, n_head=H, n_embd=H * hd, vocab_size=V, block_size=S_max, dropout=0.0)


def _llama(H: int, H_kv: int, hd: int, F: int, V: int, L: int, S_max: int = 64) -> LlamaConfig:
    return LlamaConfig(
        dim=H * hd, n_layers=L, n_heads=H, n_kv_heads=H_kv, vocab_size=V, hidden_dim=F, max_seq_len=S_max
    )


@functools.cache
def _derived(model: str, plan: str, kv_per_rank: int) -> symacct.Accounting:
    """One derivation per model, plan and (llama) key/value heads a rank: one a rank is another derivation
    (H_kv follows tp: a single head takes views where several copy)."""
    if model == "gpt2":  # kv_per_rank: the heads a rank (all heads are key/value heads), 1 or 2
        return symacct.derive(GPT2(_gpt2(2 * kv_per_rank, 8, 64, 2)), optimizer="adamw", tensor_parallel=plan, tp=2)
    cfg = _llama(4 * kv_per_rank, 2 * kv_per_rank, 8, 32, 64, 2)
    return symacct.derive(Llama(cfg), optimizer="adamw", tensor_parallel=plan, tp=2)


def _collectives(rank: symacct.parallel.rank.Rank) -> Counter:
    return Counter((c.op, c.phase, c.payload) for c in rank.collectives for _ in range(c.count))


@pytest.mark.slow  # a derivation a drawn example: in CI's slow pass (the default run's 20 minutes)
@given(
    model=st.sampled_from(["gpt2", "llama"]),
    sp=st.booleans(),
    tp=st.sampled_from([2, 3, 4]),
    kv_per_rank=st.sampled_from([1, 2]),
    rep=st.integers(2, 3),
    hd=st.sampled_from([2, 4]),
    f=st.integers(2, 3),
    v=st.integers(2, 5),
    layers=st.integers(1, 3),
    B=st.integers(2, 3),
    s=st.integers(2, 3),
)
def test_rank_on_the_fake_group(
    model: str, sp: bool, tp: int, kv_per_rank: int, rep: int, hd: int, f: int, v: int, layers: int, B: int, s: int
) -> None:
    """Every figure of a tensor-parallel rank against the rank run for real (fake group, real tensors).

    Sizes of 2 and more on every rank (B, S/tp, F/tp, V/tp, heads a rank): at a size of 1 PyTorch may take a
    view instead of a copy, which ``at()`` says in a note; grouped-query heads (H = rep * H_kv, rep >= 2)."""
    plan = "megatron-sp" if sp else "megatron"
    S, V = s * tp, v * tp
    if model == "gpt2":
        H = tp if kv_per_rank == 1 else 2 * tp * rep  # one head a rank (H follows tp), or two or more
        cfg: object = _gpt2(H, hd, V, layers)
        sizes = {"H": H, "D": H * hd, "V": V, "L": layers, "S_max": 64}
        acct = _derived("gpt2", plan, kv_per_rank)
    else:
        H_kv = kv_per_rank * tp
        H, F = rep * H_kv, f * tp
        cfg = _llama(H, H_kv, hd, F, V, layers)
        sizes = {"H": H, "H_kv": H_kv, "D": H * hd, "F": F, "V": V, "L": layers, "S_max": 64}
        acct = _derived("llama", plan, kv_per_rank)
    one = acct.at(B=B, S=S, tp=tp, **sizes)
    rank = derive_parallel(acct, make_layout(tp=tp, sequence_parallel=sp)).at(B=B, S=S, **sizes).ranks[0]
    got = tp_rank(Build(cfg), plan, tp, Batch(B, S, V), adamw)
    mem = one.memory
    assert (got.rank.params, got.rank.grads, got.rank.optimizer) == (mem.params, mem.grads, mem.optimizer)
    assert (rank.params, rank.grads, rank.optimizer) == (mem.params, mem.grads, mem.optimizer)
    assert got.saved == mem.activations
    assert got.first_peak == mem.peak
    assert got.rank.peak == rank.peak
    assert Counter(got.rank.collectives) == _collectives(rank)


@pytest.mark.parametrize(("model", "plan", "tp"), [("gpt2", "megatron-sp", 2), ("llama", "megatron", 3)])
def test_one_head_a_rank(model: str, plan: str, tp: int) -> None:
    """H = tp (and H_kv = tp): a rank's single head takes views where several heads copy, so the heads follow
    tp (a note says so) and the rank's figures are exact against the rank run for real; a model derived at
    tp = 2 is read at tp = 3 too. Before, the probe's several heads a rank were compared with the user's one
    and the model was refused as not the one given (a clone that runs only with several heads)."""
    if model == "gpt2":
        acct = symacct.derive(GPT2(_gpt2(2, 8, 64, 2)), optimizer="adamw", tensor_parallel=plan, tp=2)
        cfg: object = _gpt2(tp, 4, 6 * tp, 3)
        sizes = {"H": tp, "D": 4 * tp, "V": 6 * tp, "L": 3, "S_max": 64}
    else:
        acct = symacct.derive(Llama(_llama(2, 2, 8, 32, 64, 2)), optimizer="adamw", tensor_parallel=plan, tp=2)
        cfg = _llama(tp, tp, 4, 3 * tp, 6 * tp, 3)
        sizes = {"H": tp, "H_kv": tp, "D": 4 * tp, "F": 3 * tp, "V": 6 * tp, "L": 3, "S_max": 64}
    assert any(n.startswith(("n_head = tp", "n_heads = tp")) for n in acct.notes)
    B, S = 2, 2 * tp
    mem = acct.at(B=B, S=S, tp=tp, **sizes).memory
    rank = derive_parallel(acct, make_layout(tp=tp, sequence_parallel=plan.endswith("sp"))).at(B=B, S=S, **sizes)
    got = tp_rank(Build(cfg), plan, tp, Batch(B, S, sizes["V"]), adamw)
    assert (got.rank.params, got.rank.grads, got.rank.optimizer) == (mem.params, mem.grads, mem.optimizer)
    assert (got.saved, got.first_peak, got.rank.peak) == (mem.activations, mem.peak, rank.ranks[0].peak)
    assert Counter(got.rank.collectives) == _collectives(rank.ranks[0])
    with pytest.raises(SymacctError, match="H follows tp"):  # two heads a rank: another derivation
        acct.at(B=B, S=S, tp=tp, **{**sizes, "H": 2 * tp, "D": 8 * tp})


def test_formulas_read_as_megatrons() -> None:
    """The derived rank against a count by hand of what GPT-2's layer saves (fp32, no dropout), the form of
    Korthikanti et al.'s sbh(10 + 24/t + 5as/(ht)) and sbh(34/t + 5as/(ht)):

    - the rank runs 1/tp of the model's matmul FLOPs, exactly;
    - without sequence parallelism, whole on every rank: both layer norms' inputs and outputs (the outputs
      are what c_attn and c_fc multiply), 4 x (B, S, D), their mean and rstd (B, S) x 4, and the causal
      mask's negation masked_fill saves (bool, S x S); split over tp: q, k, v, the attention output, c_fc's
      and GELU's outputs (4D wide each): 12 x (B, S, D), and the softmax output (B, H, S, S);
    - with it, the norms' inputs and statistics split too; what stays whole is the gathered input of
      attention and of the MLP, 2 x (B, S, D): PyTorch's linear saves the gathered tensor it multiplied,
      where Megatron saves its shard and gathers it again in backward (its 34/t has no whole term)."""
    tp, L, B, S, D, H = (sym(n) for n in ("tp", "L", "B", "S", "D", "H"))
    full = symacct.derive(GPT2(_gpt2(4, 8, 64, 2)), optimizer="adamw")
    plain, seq = _derived("gpt2", "megatron", 2), _derived("gpt2", "megatron-sp", 2)
    for rank in (plain, seq):
        assert sympy.simplify(rank.flops.total * tp - full.flops.total) == 0
    layer = {k: sympy.expand(a.memory.activations).coeff(L).as_independent(tp) for k, a in (("tp", plain), ("sp", seq))}
    fp32 = 4
    want = {
        "tp": (fp32 * (4 * B * S * D + 4 * B * S) + S**2, fp32 * (12 * B * S * D + B * H * S**2) / tp),
        "sp": (fp32 * 2 * B * S * D + S**2, fp32 * (14 * B * S * D + B * H * S**2 + 4 * B * S) / tp),
    }
    for k, (whole, split) in want.items():
        assert sympy.expand(layer[k][0] - whole) == 0 and sympy.expand(layer[k][1] - split) == 0
    # and docs/distributed.md quotes them as derived
    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    quoted = dict(re.findall(r"^(tp|sp) layer activations = (.+)$", text, re.M))
    assert set(quoted) == {"tp", "sp"}
    for k, formula in quoted.items():
        names = {n: sym(n) for n in re.findall(r"[A-Za-z_]\w*", formula)}
        assert sympy.expand(sympy.sympify(formula, locals=names) - sum(layer[k])) == 0, k


def test_refusals() -> None:
    model = Llama(_llama(4, 2, 8, 32, 64, 2))
    with pytest.raises(SymacctError, match="unknown tensor-parallel plan"):
        symacct.derive(model, tensor_parallel="zigzag")
    with pytest.raises(SymacctError, match="not a tensor-parallel degree"):
        symacct.derive(model, tensor_parallel="megatron", tp=1)
    with pytest.raises(SymacctError, match="has no standard tensor-parallel plan"):
        symacct.derive(torch.nn.Linear(4, 4), tensor_parallel="megatron", inputs=lambda B, S: (torch.randn(B, 4),),
                       loss=lambda y: y.sum())  # fmt: skip
    acct = _derived("llama", "megatron", 2)
    with pytest.raises(SymacctError, match="tp=3 breaks tp divides"):  # 3 ranks do not split 4 key/value heads
        acct.at(B=1, S=6, tp=3, V=66)
    with pytest.raises(SymacctError, match="the layout asks for 'megatron-sp'"):
        derive_parallel(acct, make_layout(tp=2, sequence_parallel=True))
    with pytest.raises(SymacctError, match="needs tp >= 2"):
        derive_parallel(acct, make_layout(dp=2))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_gloo_tensor_parallel(model: str) -> None:
    """Two real gloo processes, tensor and sequence parallel: every figure to the byte, the loss of one
    process to 1e-5 relative (GPT-2's fused q/k/v reordered by its plan: the same function)."""
    net = Llama(_llama(4, 2, 8, 32, 64, 2)) if model == "llama" else GPT2(_gpt2(4, 8, 64, 2))
    for sp in (False, True):
        rows = verify_parallel(net, make_layout(tp=2, sequence_parallel=sp), B=2, S=8)
        assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_ddp_and_zero_over_tensor_parallel_ranks_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """DDP, ZeRO-1 and ZeRO-2 over tensor-parallel ranks (with dp, or with cp's ranks to reduce over) are
    refused by name, in the API and on the command line (one line, exit 2); the planner lays data parallelism
    over tensor-parallel ranks with FSDP2 (and HSDP) only; tp alone under the default mode stays derived."""
    from symacct.cli import main
    from symacct.parallel.plan import layouts

    for mode in ("ddp", "zero1", "zero2"):
        for degrees in ({"dp": 2, "tp": 2}, {"cp": 2, "tp": 2}, {"dp": 2, "tp": 2, "pp": 2}):
            with pytest.raises(SymacctError, match=f"{mode} over tensor-parallel ranks is not derived"):
                make_layout(dp_mode=mode, **degrees)  # type: ignore[arg-type]
    assert make_layout(tp=2, dp_mode="ddp").replicas == 1
    one = symacct.derive(GPT2(_gpt2(4, 8, 64, 2)), optimizer="adamw")
    laid = [lay for lay, _ in layouts(one, 8, 16, tensor_parallel={2: _derived("gpt2", "megatron", 2)}, seq=16)]
    assert {lay.dp_mode for lay in laid if lay.tp > 1 and lay.replicas > 1} == {"fsdp"}
    assert {lay.dp_mode for lay in laid if lay.tp == 1} == {"ddp", "zero1", "zero2", "fsdp"}
    assert main(["derive", "gpt2", "--dp", "2", "--tp", "2", "--dp-mode", "ddp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ddp over tensor-parallel ranks is not derived" in err[0]


@pytest.mark.slow
def test_gloo_ddp_over_tensor_parallel_is_not_the_traced_rank() -> None:
    """Why DDP over tensor-parallel ranks is refused, measured on four gloo processes (dp 2 x tp 2, PyTorch's
    composition: ``_pre_dp_module_transform``, then DDP over the data-parallel group): every rank's gradients
    are its parameters' shards, where the tensor-parallel rank traced alone holds more (the embedding's
    whole-vocabulary gradient); with sequence parallelism each norm's gradient is all-reduced over tp in
    backward, once, where the traced rank all-reduces it in the optimizer step. The loss is one process's."""
    from symacct.measure.parallel import gloo_world
    from symacct.parallel.layout import Layout

    cfg = _llama(4, 2, 8, 32, 64, 2)
    for sp in (False, True):
        got = gloo_world(Build(cfg), Layout(dp=2, tp=2, dp_mode="ddp", sequence_parallel=sp), Batch(2, 8, 64), adamw)
        alone = derive_parallel(
            _derived("llama", "megatron-sp" if sp else "megatron", 1), make_layout(tp=2, sequence_parallel=sp)
        ).at(B=2, S=8)
        traced = alone.ranks[0]
        assert traced.grads > traced.params
        norms = 2 * cfg.n_layers + 1
        for g in got:
            assert (g.params, g.grads) == (traced.params, traced.params)
            calls = Counter(g.collectives)
            assert not any(phase == "optimizer" for _op, phase, _b in calls)
            if sp:
                assert calls["all_reduce", "backward", 4 * cfg.dim] == norms
                assert sum(c.count for c in traced.collectives if c.op == "all_reduce" and c.phase == "optimizer")
        torch.manual_seed(0)
        one = Llama(cfg)
        assert got[0].loss == pytest.approx(float(one(*Batch(2, 8, 64)(one)).detach()), rel=1e-5)


@pytest.mark.slow
def test_gloo_collective_buffers_freed_in_program_order(tmp_path: Path) -> None:
    """Two gloo processes: a real run's live bytes see a finished collective's buffers freed when the
    program drops them, every time (the tensor-parallel peaks above are compared to the byte)."""
    spawn_gloo(released_collective_buffers, (40,), tmp_path)


@pytest.mark.slow
def test_gloo_reduce_scatter_counts_what_nccl_holds(tmp_path: Path) -> None:
    """Two gloo processes: a reduce-scatter's peak is its input and output, gloo's own flat copy of the input
    left out (NCCL makes none; FSDP2 over a pipeline peaked there on gloo)."""
    spawn_gloo(reduce_scatter_peak, (), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", [None, "bf16"])
def test_gloo_fsdp_by_tensor_parallel_world_four(param_dtype: str | None) -> None:
    """FSDP2 over 2 data-parallel ranks of 2 tensor-parallel ranks each (a 2-D mesh, tensor parallelism
    innermost), four real gloo processes: static bytes, every collective of rank 0 (FSDP2's and DTensor's)
    and its peak (FSDP2's buffers on the traced tensor-parallel rank) to the byte, the loss of one process.
    With MixedPrecisionPolicy(bf16): fp32 shards, bf16 gathers and DTensor's collectives in bf16, the loss
    of one process with bf16 parameters."""
    lay = make_layout(dp=2, tp=2, param_dtype=param_dtype)
    rows = verify_parallel(Llama(_llama(4, 2, 8, 32, 64, 2)), lay, B=2, S=8)
    assert any("peak" in r.name for r in rows) and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_planner_over_tensor_parallel_degrees() -> None:
    """The planner lays dp x tp x pp over each degree's own rank derivation; its compiled path gives the exact
    formulas' peak for every row, and a degree the model cannot be split by is refused by name."""
    from symacct.parallel.plan import layouts, plan

    one = symacct.derive(GPT2(_gpt2(4, 8, 64, 2)), optimizer="adamw")
    ranks = {2: _derived("gpt2", "megatron", 2)}
    rows = plan(one, gpus=8, hardware="H100-SXM", global_batch=16, seq=16, tensor_parallel=ranks)
    assert {r.layout.tp for r in rows} == {1, 2}
    for r in rows:
        assert r.layout.world == 8 and r.micro_batch * r.layout.micro_batches * r.layout.dp == 16
        acct = ranks[r.layout.tp] if r.layout.tp > 1 else one
        exact = derive_parallel(acct, r.layout).at(B=r.micro_batch, S=16)
        assert r.peak == max(k.peak for k in exact.ranks)
    assert all(lay.tp == 1 for lay, _ in layouts(one, 3, 3, tensor_parallel={3: ranks[2]}, seq=16))
    with pytest.raises(SymacctError, match="tp=3: .*tp divides"):  # 3 ranks do not split 4 heads: left out
        layouts(one, 3, 2, tensor_parallel={3: ranks[2]}, seq=16)
    with pytest.raises(SymacctError, match="tp=8 does not split this model: tp divides H"):
        symacct.derive(GPT2(_gpt2(4, 8, 64, 2)), optimizer="adamw", tensor_parallel="megatron", tp=8)


def _hf_config(family: str, **kw: object) -> object:
    """A small transformers config of ``family`` (D = 64, F = 96, L = 2, H = 8, H_kv = 4, V = 96)."""
    import transformers

    return getattr(transformers, f"{family}Config")(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=96,
        max_position_embeddings=64,
        **kw,
    )


def _carried(model: torch.nn.Module) -> dict[str, object]:
    """The model's own plan as PyTorch's styles, its paths under the runner's ``lm.``."""
    from symacct.models.hf import tp_plan

    return {f"lm.{k}": v for k, v in (tp_plan(model) or {}).items()}


def _against_the_real_rank(model: torch.nn.Module, cfg: object, asked: object, run: object) -> list[tuple]:
    """``derive`` with the plan ``asked`` beside the real rank run by the same plan ``run`` (tp = 2, B = 2,
    S = 8): the rank's bytes, saved bytes and collectives to the byte; the peaks differ by the logits alone
    (derive's causal-LM step has the caller hold the model's output, the runner returns the loss). Returns
    the real rank's collectives."""
    B, S, V = 2, 8, 96
    acct = symacct.derive(model, optimizer="adamw", tensor_parallel=asked, tp=2)
    mem = acct.at(B=B, S=S, tp=2).memory
    rank = derive_parallel(acct, make_layout(tp=2)).at(B=B, S=S).ranks[0]
    got = tp_rank(_HFBuild(cfg), run, 2, Batch(B, S, V), adamw)
    assert (got.rank.params, got.rank.grads, got.rank.optimizer) == (mem.params, mem.grads, mem.optimizer)
    assert got.saved == mem.activations
    assert Counter(got.rank.collectives) == _collectives(rank)
    logits = 4 * B * S * V
    assert (got.first_peak + logits, got.rank.peak + logits) == (mem.peak, rank.peak)
    return got.rank.collectives


@pytest.mark.slow  # a derivation more of a path the default run also covers: in CI's slow pass (20 minutes)
def test_transformers_llama_with_a_users_plan_and_its_own() -> None:
    """A transformers LlamaForCausalLM with a plan dict a user writes (parallelize_module's wildcards), and
    with the plan the model carries (``tensor_parallel="megatron"``: its ``tp_plan`` names as PyTorch's
    styles): the rank's bytes, saved bytes and collectives to the byte. The peaks differ by the logits alone:
    derive's causal-LM step has the caller hold the model's output (logits and loss), the runner returns the
    loss."""
    import transformers
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from symacct.models.hf import tp_plan

    def plan(prefix: str) -> dict[str, object]:
        layer = f"{prefix}model.layers.*."
        out: dict[str, object] = {f"{layer}self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        out |= {f"{layer}mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}
        return out | {f"{layer}self_attn.o_proj": RowwiseParallel(), f"{layer}mlp.down_proj": RowwiseParallel()}

    cfg = _hf_config("Llama")
    model = transformers.LlamaForCausalLM(cfg)
    assert "model.embed_tokens" in (tp_plan(model) or {})
    for asked, run in ((plan(""), plan("lm.")), ("megatron", _carried(model))):
        _against_the_real_rank(model, cfg, asked, run)
    with pytest.raises(SymacctError, match="no standard tensor-parallel plan with sequence parallelism"):
        symacct.derive(model, optimizer="adamw", tensor_parallel="megatron-sp", tp=2)


@pytest.mark.parametrize(
    "family", ["Qwen3", pytest.param("Mistral", marks=pytest.mark.slow), pytest.param("Olmo2", marks=pytest.mark.slow)]
)
def test_transformers_plans_beyond_llama(family: str) -> None:
    """transformers models whose own plans need more than Llama's: Qwen3's per-head ``q_norm`` / ``k_norm``
    (``replicated_with_grad_allreduce``: whole weights, gradients summed over the group, 2 L in-place
    all-reduces in backward), Mistral's sliding window (S probed below it, as without tensor
    parallelism) and Olmo2's gathered q / k / v split again by ``o_proj`` (``rowwise_split_input``): the
    rank's bytes, saved bytes, collectives and peaks to the byte against the real rank."""
    import transformers

    cfg = _hf_config(family, **({"head_dim": 8} if family == "Qwen3" else {}))
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    collectives = _against_the_real_rank(model, cfg, "megatron", _carried(model))
    norms = Counter(c for c in collectives if c == ("all_reduce", "backward", 4 * 8))
    assert sum(norms.values()) == (2 * 2 if family == "Qwen3" else 0)  # q_norm and k_norm of each block


class _HFBuild:
    def __init__(self, cfg: object) -> None:
        self.cfg = cfg

    def __call__(self) -> torch.nn.Module:
        from parallel_cases import HFLoss

        torch.manual_seed(0)
        return HFLoss(self.cfg)


def _stage_collectives(cfg: GPT2Config, plan: str, tp: int, stage: int, pp: int, B: int, S: int) -> Counter:
    """One micro-batch through pipeline stage ``stage`` of ``pp`` of a tensor-parallel GPT-2 rank, forward and
    backward, on the fake process group with real tensors: DTensor's collectives (op, phase, payload). A later
    stage's input is the local stream the stage before sends."""
    from symacct.measure.parallel import CollectiveCounter
    from symacct.trace.tensor_parallel import apply_plan, fake_group

    with fake_group(tp) as mesh:
        torch.manual_seed(0)
        model = apply_plan(GPT2(cfg), plan, mesh)
        part = model.pipeline_stage(stage, pp)
        ids = torch.randint(0, cfg.vocab_size, (B, S))
        stream = S // tp if plan == "megatron-sp" else S
        x = ids if stage == 0 else torch.randn(B, stream, cfg.n_embd, requires_grad=True)
        counter = CollectiveCounter()
        with counter:
            out = part(x)
            counter.phase = "backward"
            if stage == pp - 1:
                torch.nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
            else:
                out.backward(torch.ones_like(out))
    return Counter(counter.log)


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_pipeline_stages_of_a_tensor_parallel_rank(plan: str) -> None:
    """A tensor-parallel rank cut into pipeline stages: each stage's collectives per micro-batch against that
    stage module run on the fake process group (what runs only in block 0, sequence parallelism's split of
    the stack's input and its backward's all-gather, on the first stage alone); the stages' FLOPs add up to
    the rank's; the head's output, what the last stage returns and keeps, is the gathered logits (``4 B S
    V``, not its shard of V)."""
    from symacct.cost.layers import first_block_own
    from symacct.parallel.rank import _head_output

    cfg = dataclasses.replace(_gpt2(4, 4, 38, 4, 16), tie_weights=False)
    acct = symacct.derive(GPT2(cfg), optimizer="adamw", tensor_parallel=plan, tp=2)
    B, S, V = (sym(n) for n in ("B", "S", "V"))
    assert _head_output(acct) == 4 * B * S * V
    own = first_block_own(acct.step.ops, list(acct.per_layer))
    ops = Counter((str(acct.step.ops[t].op).split(".")[1], acct.step.ops[t].phase) for t in own)
    # the split of the stack's input (a copy of the rank's part of S) and its backward's all-gather
    assert (ops["clone", "forward"], ops["all_gather_into_tensor", "backward"]) == ((1, 1) if own else (0, 0))
    assert bool(own) == (plan == "megatron-sp")
    whole = acct.at(B=2, S=8, tp=2).flops
    for pp in (2, 4):
        par = derive_parallel(acct, make_layout(tp=2, pp=pp, schedule="gpipe", sequence_parallel=plan != "megatron"))
        ranks = {r.stage: r for r in par.at(B=2, S=8).ranks}
        kinds = [{0: "first", pp - 1: "last"}.get(stage, "middle") for stage in range(pp)]
        for stage, kind in enumerate(kinds):
            derived = Counter(
                (c.op, c.phase, c.payload)
                for c in ranks[kind].collectives
                if c.group == "tp" and c.phase != "optimizer"
                for _ in range(c.count)
            )
            assert derived == _stage_collectives(cfg, plan, 2, stage, pp, 2, 8), (plan, pp, stage)
        assert sum(ranks[k].flops for k in kinds) == whole.forward + whole.backward


@pytest.mark.parametrize("param_dtype", [None, pytest.param("bf16", marks=pytest.mark.slow)])
def test_fsdp_reduces_sequence_parallel_norm_gradients_in_backward(param_dtype: str | None) -> None:
    """FSDP2 over sequence-parallel ranks (dp = 2 x tp = 2, rank 0 on the fake process group with real
    tensors, ``_dp_step``: three steps as the gloo runner takes them): every collective of the third step
    as derived. The norms' Partial gradients are made Replicate by FSDP2's post-backward, one all-reduce
    each (in param_dtype), not by each read of the optimizer as on a tensor-parallel rank alone."""
    from symacct.measure.parallel import CollectiveCounter, _dp_step, _fake_group
    from symacct.parallel.rank import derive_compute

    cfg = dataclasses.replace(_gpt2(4, 4, 38, 2, 16), tie_weights=False)
    lay = make_layout(dp=2, tp=2, sequence_parallel=True, param_dtype=param_dtype)
    acct = symacct.derive(GPT2(cfg), optimizer="adamw", tensor_parallel="megatron-sp", tp=2)
    compute = derive_compute(GPT2(cfg), lay, optimizer="adamw", tensor_parallel="megatron-sp", tp=2)
    rank = derive_parallel(acct, lay, compute).at(B=2, S=8).ranks[0]
    with _fake_group(lay, 0):
        model = Build(cfg)()
        got = _dp_step(model, lay, 0, Batch(2, 8, 38)(model), adamw, "blocks", CollectiveCounter())
    assert Counter((op, ph, pl) for op, ph, pl in got.collectives) == _collectives(rank)
    norms = [c for c in rank.collectives if "post-backward" in c.what]
    assert sum(c.count for c in norms) == 2 * 4 + 2  # ln_1, ln_2 (weight and bias) of each block, and ln_f's
    assert all(c.phase == "backward" and c.payload == 16 * (2 if param_dtype else 4) for c in norms)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("gpt2", {"pp": 2, "sequence_parallel": True}),
        ("gpt2", {"dp": 2, "pp": 2, "sequence_parallel": True, "schedule": "gpipe"}),
        ("llama", {"dp": 2, "pp": 2, "param_dtype": "bf16", "reduce_dtype": "fp32"}),
        ("llama", {"dp": 2, "pp": 2, "sequence_parallel": True, "schedule": "interleaved", "stages_per_rank": 2}),
        ("llama", {"dp": 4, "hsdp_shard": 2, "pp": 2, "schedule": "gpipe", "micro_batches": 2}),
        # four chunks a rank: torch's lowering evicts chunks and gathers them again (8 layers: one a chunk)
        ("llama8", {"dp": 2, "pp": 2, "sequence_parallel": True, "schedule": "interleaved", "stages_per_rank": 4}),
    ],
)
def test_gloo_tensor_parallel_pipeline(model: str, layout: dict[str, Any]) -> None:
    """Tensor parallelism inside pipeline stages on real gloo processes (tp = 2 x pp = 2: 4 processes; with FSDP2 over
    dp = 2: 8, over the interleaved schedule's chunks with v = 2 and 4; HSDP 2 x 2: 16), as ``symacct verify
    --parallel`` runs them: each stage's static bytes, every collective's payload and count (DTensor's, FSDP2's, the
    stages' sends), its peak to the byte, the loss against one process. Found by this run: the last stage keeps the
    gathered logits, not its shard; sequence parallelism's split of the stack's input runs in block 0 only (the
    first stage); FSDP2 holds a vocabulary-parallel embedding's gradient whole; it makes the norms' Partial
    gradients Replicate once, in its post-backward."""
    lay = make_layout(tp=2, micro_batches=layout.pop("micro_batches", 4), dp_mode="fsdp", **layout)
    net = (
        GPT2(dataclasses.replace(_gpt2(4, 4, 38, 4, 16), tie_weights=False))
        if model == "gpt2"
        else Llama(_llama(4, 2, 8, 32, 64, 8 if model == "llama8" else 4))
    )
    rows = verify_parallel(net, lay, B=2, S=8)
    assert sum("peak" in r.name for r in rows) == 2 and all(r.ok for r in rows), [r for r in rows if not r.ok]
