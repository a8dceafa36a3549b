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

import functools
import re
from collections import Counter
from pathlib import Path

import pytest
import sympy
import torch
from hypothesis import given
from hypothesis import strategies as st
from parallel_cases import Batch, Build, adamw, reduce_scatter_peak, released_collective_buffers

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
    if model == "gpt2":
        return symacct.derive(GPT2(_gpt2(4, 8, 64, 2)), optimizer="adamw", tensor_parallel=plan, tp=2)
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
        H = 2 * tp * rep  # two heads a rank or more (one a rank is another derivation, not drawn here)
        cfg: object = _gpt2(H, hd, V, layers)
        sizes = {"H": H, "D": H * hd, "V": V, "L": layers, "S_max": 64}
        acct = _derived("gpt2", plan, 0)
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
    plain, seq = _derived("gpt2", "megatron", 0), _derived("gpt2", "megatron-sp", 0)
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


@pytest.mark.slow
def test_gloo_collective_buffers_freed_in_program_order(tmp_path: Path) -> None:
    """Two gloo processes: a real run's live bytes see a finished collective's buffers freed when the
    program drops them, every time (the tensor-parallel peaks above are compared to the byte)."""
    import torch.multiprocessing as mp

    mp.spawn(released_collective_buffers, args=(str(tmp_path / "store"), 40), nprocs=2, join=True)


@pytest.mark.slow
def test_gloo_reduce_scatter_counts_what_nccl_holds(tmp_path: Path) -> None:
    """Two gloo processes: a reduce-scatter's peak is its input and output, gloo's own flat copy of the input
    left out (NCCL makes none; FSDP2 over a pipeline peaked there on gloo)."""
    import torch.multiprocessing as mp

    mp.spawn(reduce_scatter_peak, args=(str(tmp_path / "store"),), nprocs=2, join=True)


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
    ranks = {2: _derived("gpt2", "megatron", 0)}
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
