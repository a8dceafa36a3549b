"""Context parallelism with tensor parallelism: the ring's ranks tensor-parallel too, one rank of a (cp, tp)
mesh traced on PyTorch's fake process group (tp innermost, torchtitan's order), checked against PyTorch's own
``context_parallel`` and ``parallelize_module`` run for real.

- In one process, on the fake process group with real CPU tensors (``cp_rank(..., tp=...)``): the rank's
  parameter, gradient and optimizer bytes, the bytes autograd saves, its FLOPs (flop_counter's formulas on
  the rank's local ops, ``LocalFlopCounter``), the first step's peak and a later step's, and every
  collective of both groups (op, phase, payload), all to the byte, with and without sequence parallelism.
- Against the derivations of each alone: the rank's FLOPs are the ring rank's over tp; the ring's traffic
  the ring rank's over tp (its local heads); the tensor-parallel traffic the tensor-parallel rank's at S/cp.
- On real gloo processes: FSDP2 and HSDP over the dp x cp ranks of each tensor-parallel shard (torchtitan's
  dp_shard_cp x tp): every rank's static bytes and collectives exactly, the ranks' mean loss against one
  process, the peak of the traced rank to the byte and every other at most it.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections import Counter

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parallel_cases import Batch, Build, adamw

import symacct
from symacct.errors import SymacctError
from symacct.measure.parallel import cp_rank, gloo_world
from symacct.models.llama import Llama, LlamaConfig
from symacct.parallel.layout import make_layout
from symacct.parallel.rank import derive_parallel
from symacct.symbols import sym


def _llama(H: int, H_kv: int, hd: int, F: int, V: int, L: int, S: int) -> LlamaConfig:
    """A Llama with SDPA attention whose rotary tables have S rows (context parallelism shards them whole)."""
    return LlamaConfig(
        dim=H * hd, n_layers=L, n_heads=H, n_kv_heads=H_kv, vocab_size=V, hidden_dim=F, max_seq_len=S, sdpa=True
    )


# two key/value heads a rank at the derivation's tp = 2 (one a rank is another derivation: H_kv follows tp)
MODEL = (8, 4, 8, 32, 64, 2)  # H, H_kv, hd, F, V, L


@functools.cache
def _both(plan: str, cp: int = 2) -> symacct.Accounting:
    return symacct.derive(
        Llama(_llama(*MODEL, 8 * cp)), optimizer="adamw", context_parallel=cp, tensor_parallel=plan, tp=2
    )


def _check_rank(acct: symacct.Accounting, plan: str, cp: int, tp: int, B: int, S: int, cfg: LlamaConfig) -> None:
    """Every figure of the (cp, tp) rank against the rank run for real (fake group, real tensors)."""
    sizes = {
        "H": cfg.n_heads,
        "H_kv": cfg.n_kv_heads,
        "D": cfg.dim,
        "F": cfg.hidden_dim,
        "V": cfg.vocab_size,
        "L": cfg.n_layers,
    }
    one = acct.at(B=B, S=S, tp=tp, **sizes)
    got = cp_rank(Build(cfg), cp, Batch(B, S, cfg.vocab_size), adamw, tp=tp, plan=plan)
    mem = one.memory
    assert (got.rank.params, got.rank.grads, got.rank.optimizer) == (mem.params, mem.grads, mem.optimizer)
    assert got.saved == mem.activations
    assert got.flops == one.flops.hardware  # the CPU flash backward recomputes the scores
    assert got.first_peak == mem.peak
    assert got.rank.peak == acct.liveness.steady().evaluate(acct.values_at(B=B, S=S, tp=tp, **sizes))[0]
    # FSDP2 over the cp ranks (data parallelism over tensor-parallel ranks is FSDP2's): the traced step's
    # collectives as they are, except the optimizer's all-reduces of sequence parallelism's Partial norm
    # gradients, which FSDP2's post-backward makes Replicate instead, once per parameter
    lay = make_layout(cp=cp, tp=tp, dp_mode="fsdp", sequence_parallel=plan == "megatron-sp")
    rank = derive_parallel(acct, lay).at(B=B, S=S, **sizes).ranks[0]
    assert {c.group for c in rank.collectives} >= {"tp", "cp"}
    moved = [c for c in rank.collectives if "FSDP2's post-backward" in c.what]
    traced = Counter(
        (c.op, c.phase, c.payload)
        for c in rank.collectives
        if c.group in ("tp", "cp") and c not in moved
        for _ in range(c.count)
    )
    ran = Counter(c for c in got.rank.collectives if c[1] != "optimizer")
    assert ran == traced
    in_optimizer = {(op, payload) for op, phase, payload in got.rank.collectives if phase == "optimizer"}
    assert in_optimizer == {(c.op, c.payload) for c in moved} and bool(moved) == (plan == "megatron-sp")


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_rank_on_the_fake_group(plan: str) -> None:
    """cp = 2 x tp = 2 at three sizes (each rank 2 or more of every split size: B, S/(2 cp) rows a chunk,
    heads and key/value heads a rank, F/tp, V/tp)."""
    for B, S, H, kv, F, V, L in [(2, 16, 8, 4, 32, 64, 2), (3, 24, 8, 4, 48, 70, 3), (2, 32, 12, 6, 40, 66, 1)]:
        _check_rank(_both(plan), plan, 2, 2, B, S, _llama(H, kv, 8, F, V, L, S))


@pytest.mark.slow  # a derivation a degree: in CI's slow pass
@settings(deadline=None)
@given(
    plan=st.sampled_from(["megatron", "megatron-sp"]),
    cp=st.sampled_from([2, 3]),
    tp=st.sampled_from([2, 3]),
    kv=st.integers(2, 3),
    rep=st.integers(2, 3),
    f=st.integers(4, 12),
    v=st.integers(10, 35),
    layers=st.integers(1, 3),
    B=st.integers(2, 3),
    k=st.integers(1, 2),
)
def test_rank_on_the_fake_group_drawn(
    plan: str, cp: int, tp: int, kv: int, rep: int, f: int, v: int, layers: int, B: int, k: int
) -> None:
    """Drawn degrees and sizes: S = 2 cp x tp x k (with sequence parallelism each rank's S/cp a multiple of
    tp), H_kv = kv x tp, H = rep x H_kv, F and V multiples of tp."""
    S = 2 * cp * tp * k
    H_kv = kv * tp
    cfg = _llama(rep * H_kv, H_kv, 4, f * tp, v * tp, layers, S)
    _check_rank(_both(plan, cp), plan, cp, tp, B, S, cfg)


def test_formulas_against_each_alone() -> None:
    """The (cp, tp) rank read against the ring rank's and the tensor-parallel rank's derivations (each checked
    against real runs in its own tests): its FLOPs are the ring rank's over tp, exactly (every matmul and the
    attention of its local heads split by tp); the tensor-parallel collectives carry the tensor-parallel
    rank's payloads at S/cp (its share of the sequence), as often (the ring's: the next test)."""
    S, tp = sym("S"), sym("tp")
    both = _both("megatron")
    model = Llama(_llama(*MODEL, 16))
    ring = symacct.derive(model, optimizer="adamw", context_parallel=2)
    tensor = symacct.derive(model, optimizer="adamw", tensor_parallel="megatron", tp=2)
    assert sympy.expand(both.flops.total * tp - ring.flops.total) == 0
    assert sympy.expand(both.flops.hardware * tp - ring.flops.hardware) == 0

    def kinds(acct: symacct.Accounting, lay: object, group: str, subs: dict) -> Counter:
        par = derive_parallel(acct, lay)  # type: ignore[arg-type]
        return Counter(
            {
                (c.op, c.phase, c.what, sympy.expand(c.payload.subs(subs))): c.count
                for c in par.ranks[0].collectives
                if c.group == group
            }
        )

    lay = make_layout(cp=2, tp=2, dp_mode="fsdp")
    assert kinds(both, lay, "tp", {}) == kinds(tensor, make_layout(tp=2), "tp", {S: S / 2})


def test_ring_payloads_are_the_ring_ranks_over_tp() -> None:
    """The ring's payloads, as formulas: the ring rank's divided by tp (the local heads' keys and values)."""
    tp = sym("tp")
    both = derive_parallel(_both("megatron"), make_layout(cp=2, tp=2, dp_mode="fsdp")).ranks[0]
    ring = derive_parallel(
        symacct.derive(Llama(_llama(*MODEL, 16)), optimizer="adamw", context_parallel=2),
        make_layout(cp=2, dp_mode="ddp"),
    ).ranks[0]
    mine = sorted((c.op, c.phase, sympy.expand(c.payload * tp), c.count) for c in both.collectives if c.group == "cp")
    theirs = sorted((c.op, c.phase, sympy.expand(c.payload), c.count) for c in ring.collectives if c.group == "cp")
    assert mine == theirs and len(mine) == 3


def test_planner_over_context_and_tensor_parallel() -> None:
    """The planner lays dp x cp x tp over the (cp, tp) rank's derivation: every such row's peak, step time
    and MFU are those of ``derive_parallel(...).at()`` and ``step_time``; a derivation of other degrees is
    refused."""
    from symacct.parallel.plan import layouts, plan, step_time

    one = symacct.derive(Llama(_llama(*MODEL, 16)), optimizer="adamw")
    both = {(2, 2): _both("megatron")}
    rows = plan(one, gpus=8, hardware="H100-SXM", global_batch=4, seq=16, context_tensor_parallel=both)
    mixed = [r for r in rows if r.layout.cp == 2 and r.layout.tp == 2]
    assert mixed and {r.layout.dp_mode for r in mixed} == {"fsdp"}  # data parallelism over tp ranks: FSDP2
    for r in mixed:
        assert r.layout.world == 8 and r.micro_batch * r.layout.micro_batches * r.layout.dp == 4
        exact = derive_parallel(_both("megatron"), r.layout).at(B=r.micro_batch, S=16)
        assert r.peak == max(k.peak for k in exact.ranks)
        t = step_time(exact, "H100-SXM")
        assert r.seconds == pytest.approx(t.seconds, rel=1e-12) and r.mfu == pytest.approx(t.mfu, rel=1e-12)
    with pytest.raises(SymacctError, match=r"the derivation given for cp=2 x tp=2 is one of cp=2\. derive"):
        layouts(
            one,
            8,
            4,
            seq=16,
            context_tensor_parallel={(2, 2): symacct.derive(Llama(_llama(*MODEL, 16)), context_parallel=2)},
        )
    assert {(lay.tp, lay.cp) for lay, _ in layouts(one, 8, 4, seq=16, context_tensor_parallel=both)} >= {(2, 2)}
    assert {lay.cp for lay, _ in layouts(one, 6, 3, seq=16, context_tensor_parallel=both)} == {1}  # 4 ∤ 6


def test_a_collective_of_neither_group_is_refused() -> None:
    """Each traced collective is told to the tp or the cp group by its ``group_name``; one over a group that is
    neither (here: the trace's record of its tp group dropped) is refused, naming the op and its module, never
    counted in the other group."""
    import copy

    acct = copy.copy(_both("megatron"))
    acct.step = copy.copy(acct.step)
    acct.step.groups = {name: dim for name, dim in acct.step.groups.items() if dim == "cp"} | {"elsewhere": "x"}
    acct.__dict__.pop("_parallel_formulas", None)
    with pytest.raises(SymacctError, match="ran over a process group that is neither") as e:
        derive_parallel(acct, make_layout(cp=2, tp=2, dp_mode="fsdp"))
    assert "_c10d_functional" in str(e.value)


def test_sizes_refused() -> None:
    """S not in 2 cp chunks, and with sequence parallelism S/cp not split by tp: refused by ``at()``."""
    with pytest.raises(SymacctError, match="S=18 breaks 4 divides S"):
        _both("megatron").at(B=2, S=18)
    with pytest.raises(SymacctError, match="S=20, tp=4 breaks 2[*]tp divides S"):  # S/cp rows over tp ranks
        _both("megatron-sp").at(B=2, S=20, tp=4)
    assert _both("megatron").at(B=2, S=20, tp=4).memory.peak > 0  # without sequence parallelism it runs


@pytest.mark.slow  # 4 and 8 gloo processes
def test_gloo_fsdp_over_context_and_tensor_parallel() -> None:
    """FSDP2 over the dp x cp ranks of each tensor-parallel shard, with sequence parallelism: cp = 2 x tp = 2
    (4 processes); HSDP, 2 replicas x (1 shard x cp = 2) x tp = 2 (8 processes), without. Every rank's
    static bytes and collectives exactly; the ranks' mean loss against one process (1e-5); the traced
    rank's peak to the byte, every other rank's at most it (the ring's other rank takes the head-tail
    split's other branches)."""
    B, S = 2, 32
    cfg = _llama(*MODEL, S)
    torch.manual_seed(0)
    one = Llama(cfg)
    loss = float(one(*Batch(B, S, 64)(one)).detach())
    for plan, hsdp in (("megatron-sp", None), ("megatron", 1)):
        lay = make_layout(
            dp=2 if hsdp else 1, cp=2, tp=2, dp_mode="fsdp", sequence_parallel=plan == "megatron-sp", hsdp_shard=hsdp
        )
        pred = derive_parallel(_both(plan), lay).at(B=B, S=S).ranks[0]
        groups = {"dp_shard_cp", "dp_replicate", "cp", "tp"} if hsdp else {"dp_cp", "cp", "tp"}
        assert {c.group for c in pred.collectives} == groups
        got = gloo_world(Build(cfg), lay, Batch(B, S, 64), adamw, stack="layers")
        assert len(got) == lay.world
        assert sum(g.loss for g in got) / len(got) == pytest.approx(loss, rel=1e-5)
        want = Counter((c.op, c.phase, c.payload) for c in pred.collectives for _ in range(c.count))
        for g in got:
            assert (g.params, g.grads, g.optimizer) == (pred.params, pred.grads, pred.optimizer)
            assert Counter(g.collectives) == want
            assert g.peak <= pred.peak
        assert got[0].peak == pred.peak


@pytest.mark.slow  # 8 gloo processes
def test_gloo_fsdp_over_context_and_tensor_parallel_pipeline() -> None:
    """FSDP2 over a pipeline whose stages are cp = 2 x tp = 2 (pp = 2, GPipe with 2 micro-batches; 8
    processes): the model sharded by its plan, then the stages cut, each stage module FSDP2's root over the
    ring's ranks. Every rank's static bytes and collectives exactly (FSDP2's, DTensor's, the ring's, the
    sends), the last stage's ranks' mean loss against one process, each stage's traced rank's peak to the
    byte by at() and the formula, every other rank's at most it."""
    from parallel_cases import stage

    from symacct.symbols import evaluate

    B, S, m = 2, 16, 2
    cfg = _llama(*MODEL[:-1], 4, S)
    acct = symacct.derive(Llama(cfg), optimizer="adamw", context_parallel=2, tensor_parallel="megatron")
    torch.manual_seed(0)
    one = Llama(cfg)
    loss = float(one(*Batch(m * B, S, 64)(one)).detach())
    lay = make_layout(pp=2, cp=2, tp=2, schedule="gpipe", micro_batches=m)
    par = derive_parallel(acct, lay)
    pred = par.at(B=B, S=S)
    got = gloo_world(Build(cfg), lay, Batch(m * B, S, 64), adamw, stack="layers", split=stage)
    shards = [g.loss for g in got if g.loss is not None]
    assert len(shards) == 4 and sum(shards) / 4 == pytest.approx(loss, rel=1e-5)
    for g in got:  # rank = (pp_rank * cp + cp_rank) * tp + tp_rank
        p, f = pred.ranks[g.rank // 4], par.ranks[g.rank // 4]
        assert (g.params, g.grads, g.optimizer) == (p.params, p.grads, p.optimizer)
        want = Counter((c.op, c.payload) for c in p.collectives for _ in range(c.count))
        assert Counter((op, payload) for op, _phase, payload in g.collectives) == want, g.rank
        assert evaluate(f.peak, {**pred.values, **par.held.get(f.stage, {})}) == p.peak
        assert g.peak == p.peak if g.rank % 4 < 2 else g.peak <= p.peak, g.rank


@pytest.mark.slow  # subprocesses: tens of seconds (CI's slow pass)
def test_cli() -> None:
    """``symacct derive llama --cp 2 --tp 2`` prints the rank the API derives; a size the ring and the plan
    cannot split is one line and exit 2."""
    H, H_kv, hd, F, V, L = MODEL
    cfg = {"dim": H * hd, "n_layers": L, "n_heads": H, "n_kv_heads": H_kv, "vocab_size": V, "hidden_dim": F}
    flags = [a for k, v in {**cfg, "max_seq_len": 16, "sdpa": "true"}.items() for a in ("--config", f"{k}={v}")]
    run = [sys.executable, "-m", "symacct.cli", "derive", "llama", *flags, "--batch", "2"]
    both = ["--cp", "2", "--tp", "2", "--dp-mode", "fsdp", "--json"]
    out = subprocess.run([*run, *both], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    pred = derive_parallel(_both("megatron"), make_layout(cp=2, tp=2, dp_mode="fsdp")).at(B=2, S=16).ranks[0]
    assert got["degrees"]["cp"] == 2 and got["degrees"]["tp"] == 2
    assert got["ranks"][0]["bytes"]["peak"] == pred.peak
    listed = sorted((c["op"], c["phase"], c["payload_bytes"], c["count"]) for c in got["ranks"][0]["collectives"])
    assert listed == sorted((c.op, c.phase, c.payload, c.count) for c in pred.collectives)
    planned = subprocess.run(
        [*run[:3], "plan", "llama", *flags, "--gpus", "8", "--hardware", "H100-SXM", "--seq", "16"]
        + ["--global-batch", "4", "--tp", "2", "--cp", "2", "--json"],
        capture_output=True,
        text=True,
    )
    assert planned.returncode == 0, planned.stderr
    rows = [r for r in json.loads(planned.stdout)["layouts"] if r["cp"] == 2 and r["tp"] == 2]
    assert rows and {r["pp"] for r in rows} == {1, 2}
    low = symacct.derive(  # the plan's parameters in bf16 (its default)
        Llama(_llama(*MODEL, 16)), optimizer="adamw", params_dtype="bf16", context_parallel=2,
        tensor_parallel="megatron", tp=2,
    )  # fmt: skip
    for r in rows:  # each (cp, tp) row: the API's rank at its layout
        lay = make_layout(
            dp=r["dp"], cp=2, tp=2, pp=r["pp"], dp_mode=r["dp_mode"], micro_batches=r["micro_batches"],
            hsdp_shard=r["hsdp_shard"], schedule=r["schedule"] or "1f1b", stages_per_rank=r["v"],
        )  # fmt: skip
        exact = derive_parallel(low, lay).at(B=r["micro_batch"], S=16)
        assert r["peak_bytes"] == max(k.peak for k in exact.ranks)
    bad = subprocess.run([*run, "--cp", "2", "--tp", "2", "--seq", "18"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
