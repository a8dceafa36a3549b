"""Context parallelism: one rank of PyTorch's ring attention traced on its fake process group, checked against
PyTorch's own ``context_parallel`` run for real.

- In one process, on the fake process group with real CPU tensors (``cp_rank``): the rank's parameter,
  gradient and optimizer bytes, the bytes autograd saves, its FLOPs (flop_counter's formulas on the rank's
  local ops, the CPU flash kernel's calls in the ring by its own SDPA formulas), the first step's peak and a later
  step's, and every collective the ring issues (op, phase, payload), all to the byte, at sizes hypothesis
  draws, cp = 2, 3 and 4, in fp32 and under bf16 autocast.
- On real gloo processes: the ranks' mean loss against one process (1e-5 relative), static bytes and
  collectives exactly, with DDP and FSDP2 (the peak of the ring's rank 0 to the byte, every other rank's
  at most it).
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
from hypothesis import given
from hypothesis import strategies as st
from parallel_cases import Batch, Build, adamw, stage

import symacct
from symacct.errors import SymacctError
from symacct.measure.parallel import cp_rank, gloo_world, verify_parallel
from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.models.llama import Llama, LlamaConfig
from symacct.parallel.layout import make_layout
from symacct.parallel.rank import derive_parallel
from symacct.symbols import evaluate, sym


def _llama(H: int, H_kv: int, hd: int, F: int, V: int, L: int, S: int, sdpa: bool = True) -> LlamaConfig:
    """A Llama whose rotary tables have S rows: context parallelism shards them whole (S_max = S)."""
    return LlamaConfig(
        dim=H * hd, n_layers=L, n_heads=H, n_kv_heads=H_kv, vocab_size=V, hidden_dim=F, max_seq_len=S, sdpa=sdpa
    )


@functools.cache
def _derived(cp: int, autocast: str | None = None) -> symacct.Accounting:
    return symacct.derive(
        Llama(_llama(4, 2, 8, 32, 64, 2, 8 * cp)), optimizer="adamw", context_parallel=cp, autocast=autocast
    )


def _ring(rank: symacct.parallel.rank.Rank) -> Counter:
    return Counter((c.op, c.phase, c.payload) for c in rank.collectives if c.group == "cp" for _ in range(c.count))


@pytest.mark.slow  # a derivation a drawn example: in CI's slow pass (the default run's 20 minutes)
@given(
    cp=st.sampled_from([2, 3, 4]),
    autocast=st.sampled_from([None, "bf16"]),
    kv=st.integers(2, 3),
    rep=st.integers(2, 3),
    hd=st.sampled_from([4, 8]),
    F=st.integers(8, 24),
    V=st.integers(20, 70),
    layers=st.integers(1, 3),
    B=st.integers(2, 3),
    k=st.integers(2, 4),
)
def test_rank_on_the_fake_group(
    cp: int, autocast: str | None, kv: int, rep: int, hd: int, F: int, V: int, layers: int, B: int, k: int
) -> None:
    """Every figure of a context-parallel rank against the rank run for real (fake group, real tensors).

    S = 2 * cp * k, k >= 2: each of the 2 cp chunks of the head-tail split at least 2 rows; B, H_kv and
    H / H_kv at least 2 (at 1 PyTorch may take a view for a copy, which ``at()`` says in a note)."""
    S, H = 2 * cp * k, kv * rep
    cfg = _llama(H, kv, hd, F, V, layers, S)
    acct = _derived(cp, autocast)
    sizes = {"H": H, "H_kv": kv, "D": H * hd, "F": F, "V": V, "L": layers}
    one = acct.at(B=B, S=S, **sizes)
    got = cp_rank(Build(cfg), cp, Batch(B, S, V), adamw, autocast=torch.bfloat16 if autocast else None)
    mem = one.memory
    assert (got.rank.params, got.rank.grads, got.rank.optimizer) == (mem.params, mem.grads, mem.optimizer)
    assert got.saved == mem.activations
    assert got.flops == one.flops.hardware  # flop_counter's CPU flash backward recomputes the scores
    assert got.first_peak == mem.peak
    assert got.rank.peak == acct.liveness.steady().evaluate(acct.values_at(B=B, S=S, **sizes))[0]
    rank = derive_parallel(acct, make_layout(cp=cp, dp_mode="ddp")).at(B=B, S=S, **sizes).ranks[0]
    assert Counter(got.rank.collectives) == _ring(rank)


def test_ring_formulas() -> None:
    """The rank's FLOPs and ring traffic read as PyTorch's ring runs them (fp32, cp = 2 and 4):

    - every op outside attention on S/cp rows: 1/cp of the single device's;
    - attention: the rank's queries against its own keys (S/cp squared, causal, which flop_counter counts
      whole) and cp - 1 blocks of S/cp by S/(2 cp) (half of the queries, or half of the keys, with the
      head-tail split), at flop_counter's 4 B S_q S_kv D forward and 8 backward (10 with the recomputed
      scores, which the hardware figure counts): (cp + 1) / (2 cp^2) of the single device's 12 B S^2 D;
    - a layer's keys and values (the model repeats its H_kv heads to H before SDPA) all-gathered once
      forward and once backward: cp x 2 x B x S/cp x D fp32; their gradients sent round the ring in fp32,
      cp all-to-alls of 2 x B x S/cp x D."""
    B, S, D, L, m = (sym(n) for n in ("B", "S", "D", "L", "m"))  # m: micro-batches a step
    whole = symacct.derive(Llama(_llama(4, 2, 8, 32, 64, 2, 16)), optimizer="adamw")
    outside = sympy.expand(whole.flops.total - 12 * B * D * L * S**2)  # the single device less its SDPA
    assert sympy.expand(whole.flops.hardware - whole.flops.total - 2 * B * D * L * S**2) == 0
    for cp in (2, 4):
        acct = _derived(cp)
        blocks = (S / cp) ** 2 * (1 + sympy.Rational(cp - 1, 2))  # S_q x S_kv summed over the ring's steps
        assert sympy.expand(acct.flops.total - outside / cp - 12 * B * D * L * blocks) == 0
        assert sympy.expand(acct.flops.hardware - outside / cp - 14 * B * D * L * blocks) == 0
        rank = derive_parallel(acct, make_layout(cp=cp, dp_mode="ddp")).ranks[0]
        got = {(c.op, c.phase): (sympy.expand(c.payload), c.count) for c in rank.collectives if c.group == "cp"}
        assert got == {
            ("all_gather", "forward"): (sympy.expand(cp * 2 * B * (S / cp) * D * 4), L * m),
            ("all_gather", "backward"): (sympy.expand(cp * 2 * B * (S / cp) * D * 4), L * m),
            ("all_to_all", "backward"): (sympy.expand(2 * B * (S / cp) * D * 4), cp * L * m),
        }


def test_refusals() -> None:
    model = Llama(_llama(4, 2, 8, 32, 64, 2, 16))
    with pytest.raises(SymacctError, match="not a degree"):
        symacct.derive(model, context_parallel=1)
    with pytest.raises(SymacctError, match="prime factor above 7"):
        symacct.derive(model, context_parallel=11)
    with pytest.raises(SymacctError, match="step='train'"):
        symacct.derive(model, context_parallel=2, step="forward")
    with pytest.raises(SymacctError, match="ran no attention as a ring"):  # eager attention: shard-local only
        symacct.derive(Llama(_llama(4, 2, 8, 32, 64, 2, 16, sdpa=False)), context_parallel=2)
    gpt2 = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=16, dropout=0.0, sdpa=True))
    with pytest.raises(SymacctError, match="context_parallel_buffers"):  # positions from arange(local S)
        symacct.derive(gpt2, context_parallel=2)
    acct = _derived(2)
    with pytest.raises(SymacctError, match="4 divides S"):
        acct.at(B=1, S=18)
    with pytest.raises(SymacctError, match="this derivation is one context-parallel rank's of cp=2"):
        derive_parallel(acct, make_layout(dp=2))
    with pytest.raises(SymacctError, match="layout has cp=4"):
        derive_parallel(acct, make_layout(cp=4))
    assert make_layout(cp=2, pp=2, dp_mode="ddp", micro_batches=2).replicas == 2


@pytest.mark.slow
def test_gloo_context_parallel() -> None:
    """Two real gloo processes running PyTorch's context_parallel (cp = 2) under DDP and under FSDP2: the
    ranks' mean loss is one process's; static bytes and every collective exactly; the peak, DDP's and
    FSDP2's (its buffers placed on the traced ring rank, symacct.parallel.fsdp): rank 0's to the byte (the
    ring's rank 0 is the one traced; rank 1 takes the other branches of the head-tail split and holds
    less)."""
    B, S = 2, 32
    cfg = _llama(4, 2, 8, 32, 64, 2, S)
    acct = _derived(2)
    torch.manual_seed(0)
    one = Llama(cfg)
    loss = float(one(*Batch(B, S, 64)(one)).detach())
    for mode in ("ddp", "fsdp"):
        lay = make_layout(cp=2, dp_mode=mode)
        pred = derive_parallel(acct, lay).at(B=B, S=S).ranks[0]
        got = gloo_world(Build(cfg), lay, Batch(B, S, 64), adamw, stack="layers")
        assert sum(g.loss for g in got) / 2 == pytest.approx(loss, rel=1e-5)
        want = Counter((c.op, c.phase, c.payload) for c in pred.collectives for _ in range(c.count))
        for g in got:
            assert (g.params, g.grads, g.optimizer) == (pred.params, pred.grads, pred.optimizer)
            assert Counter(g.collectives) == want
        if mode == "ddp":
            assert got[0].peak == pred.peak and got[1].peak <= got[0].peak
        else:
            assert got[0].peak == pred.peak and got[1].peak <= got[0].peak


@pytest.mark.slow
def test_gloo_hsdp_over_context_parallel() -> None:
    """HSDP over context-parallel ranks, dp = 4 (2 replicas of shard groups of 2) x cp = 2, on eight gloo
    processes: FSDP2 over the (replicate, shard x cp) mesh, torchtitan's dp_shard_cp. Every rank's static
    bytes and every collective exactly (all-gathers and reduce-scatters over shard x cp = 4 ranks, the
    gradient shards all-reduced over the 2 replicas, the ring's all-to-alls); the ranks' mean loss against
    one process; the peak of the ring's rank 0 to the byte, the other ring rank's at most it."""
    B, S = 2, 32
    cfg = _llama(4, 2, 8, 32, 64, 2, S)
    acct = symacct.derive(Llama(cfg), optimizer="adamw", context_parallel=2)
    torch.manual_seed(0)
    one = Llama(cfg)
    loss = float(one(*Batch(B, S, 64)(one)).detach())
    lay = make_layout(dp=4, cp=2, dp_mode="fsdp", hsdp_shard=2)
    pred = derive_parallel(acct, lay).at(B=B, S=S).ranks[0]
    assert {c.group for c in pred.collectives} == {"dp_shard_cp", "dp_replicate", "cp"}
    got = gloo_world(Build(cfg), lay, Batch(B, S, 64), adamw, stack="layers")
    assert sum(g.loss for g in got) / len(got) == pytest.approx(loss, rel=1e-5)
    want = Counter((c.op, c.phase, c.payload) for c in pred.collectives for _ in range(c.count))
    for g in got:  # rank = dp_rank * cp + cp_rank
        assert (g.params, g.grads, g.optimizer) == (pred.params, pred.grads, pred.optimizer)
        assert Counter(g.collectives) == want
        assert g.peak == pred.peak if g.rank % 2 == 0 else g.peak <= pred.peak


@pytest.mark.slow
def test_gloo_context_parallel_over_pipeline() -> None:
    """A pipeline of context-parallel stages, pp = 2 x cp = 2 on four gloo processes (each step in PyTorch's
    context_parallel over the cp ranks, DDP over them: the ring's ranks hold the same weights), GPipe with 2
    micro-batches, 1F1B with 4 and the interleaved schedule (v = 2, one DDP reducer per stage chunk): every
    rank's static bytes, sends and all-reduces exactly, the last stage's ranks' mean loss against one
    process, and each stage's peak, its ring rank 0's to the byte by at() and the formula, the other's at
    most it."""
    B, S = 2, 16
    cfg = _llama(4, 2, 8, 32, 64, 4, S)
    acct = symacct.derive(Llama(cfg), optimizer="adamw", context_parallel=2)
    torch.manual_seed(0)
    one = Llama(cfg)
    for schedule, m, v in (("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2)):
        loss = float(one(*Batch(m * B, S, 64)(one)).detach())
        lay = make_layout(pp=2, cp=2, dp_mode="ddp", schedule=schedule, micro_batches=m, stages_per_rank=v)
        par = derive_parallel(acct, lay)
        pred = par.at(B=B, S=S)
        got = gloo_world(Build(cfg), lay, Batch(m * B, S, 64), adamw, stack="layers", split=stage)
        shards = [g.loss for g in got if g.loss is not None]
        assert len(shards) == 2 and sum(shards) / 2 == pytest.approx(loss, rel=1e-5)
        for g in got:  # rank = pp_rank * cp + cp_rank
            p, f = pred.ranks[g.rank // 2], par.ranks[g.rank // 2]
            assert (g.params, g.grads, g.optimizer) == (p.params, p.grads, p.optimizer)
            want = Counter((c.op, c.payload) for c in p.collectives for _ in range(c.count))
            assert Counter((op, payload) for op, _phase, payload in g.collectives) == want, schedule
            formula = evaluate(f.peak, {**pred.values, **par.held.get(f.stage, {})})
            assert (g.peak == p.peak == formula) if g.rank % 2 == 0 else g.peak <= p.peak, (schedule, g.rank)


def test_fsdp_pipeline_formula_equals_at() -> None:
    """FSDP2 over a pipeline of context-parallel stages (the ring's ranks shard each stage): each stage's peak
    formula equals at() at sizes other than the probe's, for GPipe and 1F1B, with and without
    ``reshard_after_forward``, and with HSDP; the shards and the gathers span the dp x cp ranks."""
    acct = symacct.derive(Llama(_llama(4, 2, 8, 32, 64, 4, 16)), optimizer="adamw", context_parallel=2)
    for schedule, m, reshard, dp, hsdp in (
        ("gpipe", 2, True, 1, None),
        ("1f1b", 4, True, 1, None),
        ("1f1b", 4, False, 1, None),
        ("gpipe", 2, True, 2, 1),
    ):
        lay = make_layout(
            pp=2, cp=2, dp=dp, schedule=schedule, micro_batches=m, reshard_after_forward=reshard, hsdp_shard=hsdp
        )
        par = derive_parallel(acct, lay)
        assert {c.group for c in par.ranks[0].collectives} >= ({"dp_shard_cp", "dp_replicate"} if hsdp else {"dp_cp"})
        for B, S, D in ((2, 16, 32), (3, 24, 48)):
            at = par.at(B=B, S=S, D=D, H=4, H_kv=2)
            for f, r in zip(par.ranks, at.ranks, strict=True):
                assert evaluate(f.peak, {**at.values, **par.held.get(f.stage, {})}) == r.peak, (schedule, f.stage)


@pytest.mark.slow
def test_gloo_fsdp_over_context_parallel_pipeline() -> None:
    """FSDP2 over a pipeline of context-parallel stages, pp = 2 x cp = 2 on four gloo processes (each stage
    module FSDP2's root over the ring's ranks, its blocks sharded): GPipe with 2 micro-batches, 1F1B with 4,
    1F1B without ``reshard_after_forward``, the interleaved schedule with v = 2; HSDP, 2 replicas x cp = 2
    x pp = 2, on eight. Every rank's static bytes, all-gathers, reduce-scatters, all-reduces and sends
    exactly, the last stage's ranks' mean loss against one process, each stage's ring rank 0's peak to the
    byte by at() (and the formula but at the interleaved schedule's one block a chunk, where it is above),
    the other ring rank's at most it."""
    B, S = 2, 16
    cfg = _llama(4, 2, 8, 32, 64, 4, S)
    acct = symacct.derive(Llama(cfg), optimizer="adamw", context_parallel=2)
    torch.manual_seed(0)
    one = Llama(cfg)
    cases = (("gpipe", 2, 1, True, None), ("1f1b", 4, 1, True, None), ("1f1b", 2, 1, False, None))
    cases += (("interleaved", 2, 2, True, None), ("1f1b", 2, 1, True, 1))
    for schedule, m, v, reshard, hsdp in cases:
        loss = float(one(*Batch(m * B, S, 64)(one)).detach())
        lay = make_layout(
            dp=2 if hsdp else 1, pp=2, cp=2, schedule=schedule, micro_batches=m, stages_per_rank=v,
            reshard_after_forward=reshard, hsdp_shard=hsdp,
        )  # fmt: skip
        par = derive_parallel(acct, lay)
        pred = par.at(B=B, S=S)
        got = gloo_world(Build(cfg), lay, Batch(m * B, S, 64), adamw, stack="layers", split=stage)
        shards = [g.loss for g in got if g.loss is not None]
        assert len(shards) == lay.world // 2 and sum(shards) / len(shards) == pytest.approx(loss, rel=1e-5)
        per = lay.world // 2  # ranks a stage: rank = pp_rank * dp * cp + dp_rank * cp + cp_rank
        for g in got:
            p, f = pred.ranks[g.rank // per], par.ranks[g.rank // per]
            assert (g.params, g.grads, g.optimizer) == (p.params, p.grads, p.optimizer), (schedule, g.rank)
            want = Counter((c.op, c.payload) for c in p.collectives for _ in range(c.count))
            assert Counter((op, payload) for op, _phase, payload in g.collectives) == want, (schedule, g.rank)
            formula = evaluate(f.peak, {**pred.values, **par.held.get(f.stage, {})})
            assert formula == p.peak if v == 1 else formula >= p.peak
            assert g.peak == p.peak if g.rank % 2 == 0 else g.peak <= p.peak, (schedule, g.rank)


@pytest.mark.slow
def test_verify_context_parallel_with_data_parallel_world_four() -> None:
    """FSDP2 over dp = 2 x cp = 2 on four gloo processes, as ``symacct verify --parallel --dp 2 --cp 2``
    runs it: every judged row holds (static bytes, collectives, the ranks' mean loss)."""
    model = Llama(_llama(4, 2, 8, 32, 64, 2, 16))
    rows = verify_parallel(model, make_layout(dp=2, cp=2), B=2, S=16)
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert any(r.name.startswith("loss (ranks' mean") for r in rows)


def test_planner_over_context_parallel_degrees() -> None:
    """The planner lays dp x cp x pp over the ring rank's derivation (DDP, ZeRO and FSDP2 without a pipeline,
    HSDP over dp x cp, DDP, ZeRO-1 and FSDP2 over a pipeline's stages); every row's peak, step time and MFU
    are those of ``derive_parallel(...).at()`` and ``step_time``; a degree whose ring cannot cut S into 2 cp
    chunks is left out, and a derivation of another degree is refused."""
    from symacct.parallel.plan import layouts, plan, step_time

    one = symacct.derive(Llama(_llama(4, 2, 8, 32, 64, 2, 16)), optimizer="adamw")
    rows = plan(one, gpus=4, hardware="H100-SXM", global_batch=8, seq=16, context_parallel={2: _derived(2)})
    ring = [r for r in rows if r.layout.cp == 2]
    assert ring and {r.layout.dp_mode for r in ring} == {"ddp", "zero1", "zero2", "fsdp"}
    assert all(r.layout.tp == 1 for r in ring)
    assert {r.layout.dp_mode for r in ring if r.layout.pp == 2} == {"ddp", "zero1", "fsdp"}
    assert any(r.layout.hsdp_shard for r in ring)
    for r in rows:
        assert r.layout.world == 4 and r.micro_batch * r.layout.micro_batches * r.layout.dp == 8
        exact = derive_parallel(_derived(2) if r.layout.cp > 1 else one, r.layout).at(B=r.micro_batch, S=16)
        assert r.peak == max(k.peak for k in exact.ranks)
        t = step_time(exact, "H100-SXM")
        assert r.seconds == pytest.approx(t.seconds, rel=1e-12) and r.mfu == pytest.approx(t.mfu, rel=1e-12)
    assert {lay.cp for lay, _ in layouts(one, 4, 8, seq=10, context_parallel={2: _derived(2)})} == {1}
    with pytest.raises(SymacctError, match="no valid layout .*cp=2: .*S=10 breaks 4 divides S"):
        layouts(one, 4, 3, seq=10, context_parallel={2: _derived(2)})
    with pytest.raises(SymacctError, match=r"given for cp=4 is one of cp=2\. derive\(model, context_parallel=4"):
        layouts(one, 4, 8, seq=16, context_parallel={4: _derived(2)})


@pytest.mark.slow  # subprocesses and the planner: tens of seconds (CI's slow pass)
def test_cli() -> None:
    """``symacct derive llama --cp 2`` prints the rank the API derives (its bytes and the ring's collectives);
    a layout it cannot derive is one line and exit 2."""
    cfg = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "hidden_dim": 32}
    flags = [a for k, v in {**cfg, "max_seq_len": 16, "sdpa": "true"}.items() for a in ("--config", f"{k}={v}")]
    run = [sys.executable, "-m", "symacct.cli", "derive", "llama", *flags, "--batch", "2"]
    out = subprocess.run([*run, "--cp", "2", "--dp-mode", "ddp", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    pred = derive_parallel(_derived(2), make_layout(cp=2, dp_mode="ddp")).at(B=2, S=16).ranks[0]
    assert got["degrees"]["cp"] == 2 and "cp=2 (ring attention)" in got["layout"]
    assert got["ranks"][0]["bytes"]["peak"] == pred.peak
    ring = sorted((c["op"], c["phase"], c["payload_bytes"], c["count"]) for c in got["ranks"][0]["collectives"])
    assert [r for r in ring if r[0] != "all_reduce"] == sorted(
        (c.op, c.phase, c.payload, c.count) for c in pred.collectives if c.group == "cp"
    )
    planned = subprocess.run(
        [*run[:3], "plan", "llama", *flags, "--gpus", "4", "--hardware", "H100-SXM", "--seq", "16"]
        + ["--global-batch", "4", "--tp", "1", "--cp", "2", "--json"],
        capture_output=True,
        text=True,
    )
    assert planned.returncode == 0, planned.stderr
    got_rows = json.loads(planned.stdout)["layouts"]
    assert {r["cp"] for r in got_rows} == {1, 2}
    low = symacct.derive(
        Llama(_llama(4, 2, 8, 32, 64, 2, 16)), optimizer="adamw", params_dtype="bf16", context_parallel=2
    )
    assert {r["pp"] for r in got_rows if r["cp"] == 2} == {1, 2}  # pipelines over the rings too
    for r in got_rows:  # the plan's parameters in bf16 (its default)
        if r["cp"] == 2:
            lay = make_layout(
                dp=r["dp"], cp=2, pp=r["pp"], dp_mode=r["dp_mode"], micro_batches=r["micro_batches"],
                hsdp_shard=r["hsdp_shard"], schedule=r["schedule"] or "1f1b", stages_per_rank=r["v"],
            )  # fmt: skip
            exact = derive_parallel(low, lay).at(B=r["micro_batch"], S=16)
            assert r["peak_bytes"] == max(k.peak for k in exact.ranks)
    bad = subprocess.run([*run, "--cp", "3"], capture_output=True, text=True)  # S = 16 is not in 6 chunks
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "2*cp = 6 chunks" in bad.stderr, bad.stderr
