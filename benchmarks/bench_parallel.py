"""Parallel layouts, side by side with the alternative (docs/benchmark-parallel.txt).

1. Llama-3-70B (bf16, AdamW, SDPA, activation checkpointing, on meta): derive alone, and derive followed
   by the per-rank figures of a layout (FSDP2 over 64 GPUs; then 8 x 8 ZeRO-1 x 1F1B; a tensor- and
   sequence-parallel rank, tp = 8, traced on the fake process group, in FSDP2 dp = 4 x 1F1B pp = 2; a
   context-parallel rank, PyTorch's ring over cp = 2 and 8, in FSDP2 over dp x cp = 64): issue 14's target
   is at most 3x the single-device derive.
2. The planner: every layout of that model on 64 H100s (S = 8192, global batch 1024), ranked, tp = 1,
   tp = 2, 4, 8 with sequence parallelism, and cp = 2, 8 with data parallelism (their derivations made
   before the clock starts): the target is at least 100 layouts in at most 10 s.
3. GPT-2 small, FSDP2 over 8 ranks: one rank run on PyTorch's fake process group (what torchtitan's
   estimator does: one number per size and rank) against derive_parallel, whose formulas then give any
   size and rank count; both are checked equal at the run's size (rank 0's static bytes, every payload).

Every ratio is measured in one run on one machine; machines differ 3-4x in speed, and one derivation's time
varies by 10-40% from run to run on the same machine: each time is the median of three runs (each on
fresh derivations; the planner's first call, its module caches cleared). The garbage collector
runs before each timed section (``_clock``), not inside it: a full collection of this process's million
objects takes about 0.5 s, and lands in whichever section crosses its threshold (as ``timeit`` keeps it out).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import symacct
from symacct import memo
from symacct.measure.parallel import fake_rank
from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.models.presets import PRESETS
from symacct.parallel.layout import make_layout
from symacct.parallel.plan import clear_caches, plan
from symacct.parallel.rank import derive_parallel

REPEATS = 3


def llama70b() -> torch.nn.Module:
    cls, make = PRESETS["llama3-70b"]
    with torch.device("meta"):
        return cls(dataclasses.replace(make(), sdpa=True, checkpoint=True))


def derive70b(**rank: object) -> symacct.Accounting:
    return symacct.derive(llama70b(), optimizer="adamw", params_dtype="bf16", **rank)


@dataclasses.dataclass(frozen=True)
class _Build:
    config: GPT2Config

    def __call__(self) -> GPT2:
        return GPT2(self.config)


def _batch(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return model.example_inputs(8, 1024)


def _clock() -> float:
    """The time, after a full garbage collection (see the module docstring)."""
    gc.collect()
    return time.perf_counter()


def _median(run: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, Any]:
    """``run()``'s median time over ``repeats`` runs (a garbage collection before each, see ``_clock``) and the
    last run's result: one run of a derivation varies by 10-40% on these machines from run to run. One run
    first, untimed, as for the derive alone (``main``'s warm-up): a process's first tensor- or context-
    parallel trace also pays for the modules and dispatch caches it is the first to use."""
    run()
    times, got = [], None
    for _ in range(repeats):
        t = _clock()
        got = run()
        times.append(time.perf_counter() - t)
    return statistics.median(times), got


def _then(first: Callable[[], Any], second: Callable[[Any], Any]) -> tuple[float, float]:
    """Median times of ``first()`` and of ``second`` on its result, each pair on a fresh result (one pair first,
    untimed: ``_median``)."""
    second(first())
    a, b = [], []
    for _ in range(REPEATS):
        t = _clock()
        got = first()
        a.append(time.perf_counter() - t)
        t = _clock()
        second(got)
        b.append(time.perf_counter() - t)
    return statistics.median(a), statistics.median(b)


def _with(layout: Any, **rank: object) -> Callable[[], symacct.Accounting]:
    """A derivation of the 70B (``rank``: its tensor- or context-parallel rank) and ``layout``'s figures."""

    def run() -> symacct.Accounting:
        acct = derive70b(**rank)
        derive_parallel(acct, layout).at(B=1, S=8192)
        return acct

    return run


def _planned() -> tuple[float, list[Any]]:
    """The planner's first call over fresh derivations (its formulas and evaluations are kept on them, the
    schedules' action lists, points and makespans in module caches, all cleared here: ``clear_caches``):
    seconds and the ranked rows."""
    acct = derive70b()
    accts = {tp: derive70b(tensor_parallel="megatron-sp", tp=tp) for tp in (2, 4, 8)}
    cps = {cp: derive70b(context_parallel=cp) for cp in (2, 8)}
    clear_caches()
    t = _clock()
    rows = plan(
        acct, gpus=64, hardware="H100-SXM", global_batch=1024, seq=8192, tensor_parallel=accts, context_parallel=cps
    )
    return time.perf_counter() - t, rows


def main() -> None:
    memo.FAMILIES.enabled = False  # every derivation traced afresh, as these figures have always been (symacct.memo)
    print(f"torch {torch.__version__}, symacct {symacct.__version__}; each time the median of {REPEATS} runs")
    derive70b()  # warm-up: imports, caches
    single, _ = _median(derive70b)
    with_layout, second = _then(
        _with(make_layout(dp=64, dp_mode="fsdp")),
        lambda a: derive_parallel(a, make_layout(dp=8, pp=8, dp_mode="zero1", micro_batches=128)).at(B=1, S=8192),
    )
    fsdp_pipe, _ = _median(_with(make_layout(dp=8, pp=8, dp_mode="fsdp", micro_batches=16)))
    tp_lay = make_layout(dp=4, tp=8, pp=2, dp_mode="fsdp", micro_batches=8, sequence_parallel=True)
    with_tp, _ = _median(_with(tp_lay, tensor_parallel="megatron-sp", tp=8))
    with_cp = {}
    for cp in (2, 8):
        with_cp[cp], _ = _median(_with(make_layout(dp=64 // cp, cp=cp, dp_mode="fsdp"), context_parallel=cp))
    print("1. Llama-3-70B (bf16, AdamW, SDPA, checkpointing, meta)")
    print(f"   derive alone:                           {single:.2f} s")
    print(f"   derive + FSDP2 dp=64 per-rank figures:  {with_layout:.2f} s  ({with_layout / single:.2f}x; target 3x)")
    print(f"   then dp=8 x pp=8 ZeRO-1 1F1B (m=128):   {second:.2f} s")
    print(f"   derive + FSDP2 dp=8 x pp=8 1F1B (m=16): {fsdp_pipe:.2f} s  ({fsdp_pipe / single:.2f}x; target 3x)")
    print(f"   derive a tp=8 sp rank + dp=4 x pp=2:    {with_tp:.2f} s  ({with_tp / single:.2f}x; target 3x)")
    for cp, sec in with_cp.items():
        what = f"derive a cp={cp} rank + FSDP2 dp={64 // cp}:"
        print(f"   {what:<40}{sec:.2f} s  ({sec / single:.2f}x; target 3x; the ring unrolled {cp} steps)")

    times = []
    for _ in range(REPEATS):
        planned, rows = _planned()
        times.append(planned)
    planned = statistics.median(times)
    best = rows[0]
    print("2. the planner, Llama-3-70B on 64 x H100-SXM, S=8192, global batch 1024")
    runs = ", ".join(f"{t:.2f}" for t in times)
    print(f"   {len(rows)} layouts ranked in {planned:.2f} s ({sum(r.fits for r in rows)} fit; target 100 in 10 s)")
    print(f"   the three first calls: {runs} s")
    kinds = Counter("tp" if r.layout.tp > 1 else "cp" if r.layout.cp > 1 else "dp x pp" for r in rows)
    print(f"   of which {kinds['dp x pp']} dp x pp, {kinds['tp']} with tp = 2, 4, 8, {kinds['cp']} with cp = 2, 8")
    print(
        f"   first: {best.layout.describe()}, B={best.micro_batch}: {best.peak / 1e9:.1f} GB, {best.seconds:.1f} s/step"
    )

    cfg = GPT2Config(dropout=0.0)
    lay = make_layout(dp=8, dp_mode="fsdp")
    t = _clock()
    got = fake_rank(_Build(cfg), lay, 0, _batch, lambda p: torch.optim.AdamW(p, lr=1e-3))
    run = time.perf_counter() - t
    small = symacct.derive(GPT2(cfg), optimizer="adamw")
    t = _clock()
    par = derive_parallel(small, lay)
    r = par.at(B=8, S=1024).ranks[0]
    formulas = time.perf_counter() - t
    t = _clock()
    for dp in (2, 4, 16, 32, 64, 128, 256, 512, 1024, 2048):
        derive_parallel(small, make_layout(dp=dp, dp_mode="fsdp")).at(B=8, S=1024)
    ten = time.perf_counter() - t
    assert (got.params, got.grads, got.optimizer) == (r.params, r.grads, r.optimizer)
    assert Counter(got.collectives) == Counter(
        (c.op, c.phase, c.payload) for c in r.collectives for _ in range(c.count)
    )
    print("3. GPT-2 small, FSDP2 dp=8, B=8, S=1024, rank 0")
    print(f"   fake process group run:        {run:.2f} s (one size, one rank count)")
    print(f"   derive_parallel + at():        {formulas:.3f} s  ({formulas / run:.3f}x; equal bytes and payloads)")
    print(f"   ten more rank counts (2-2048): {ten:.3f} s")


if __name__ == "__main__":
    main()
