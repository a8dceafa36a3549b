"""Where derive's time goes: each stage of one derive of a gpt2-small training step, timed in place.

The stages are the functions ``symacct.derive``'s passes call (``symacct/pipeline.py``),
wrapped with a timer for one run after a warm-up derive (so that imports and
first-call caches are not counted); beside them, one FlopCounterMode pass of
the same step on meta tensors, and the same step on bare fake tensors (no
recording), the floor a trace cannot go below.

    python benchmarks/profile_derive.py [--optimizer adamw] [--repeats 3] [--memo]
    python benchmarks/profile_derive.py --floor [--repeats 5]

``--floor`` prints only what one step costs before anything is recorded: on meta tensors (with and without
FlopCounterMode) and on fake tensors (the dispatch cache hit, missed at new widths, or off).

The family memo (symacct.memo) is off unless ``--memo``: with it, the warm-up derive fills it and the timed
derives trace only the user's model.

docs/profile-derive.md quotes its output.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from yardstick import flop_counter_pass, gpt2

import symacct
from symacct import memo
from symacct.models import GPT2, GPT2Config

DERIVE = importlib.import_module("symacct.pipeline")  # the module (symacct.derive is the function)
STAGES = (
    ("_record", "probe traces (the first probe, L=4; the check, L=5, other sizes)"),
    ("_same_model", "the user's model traced and compared (sameness)"),
    ("cost_ops", "rules: a cost per op (symbolic, and plain for the check)"),
    ("factor", "layer stack factored"),
    ("_check", "formulas checked against the second trace"),
    ("build_graph", "networkx graph"),
    ("static_and_activations", "static bytes, saved activations"),
    ("_check_memory", "memory formulas checked against the second trace"),
    ("liveness", "storage lifetimes, one block more"),
    ("fill_phases", "phase points and the symbolic peak"),
    ("aggregate", "totals per phase, module, component"),
    ("learn_constraints", "size constraints"),
)


def _timed(table: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            table[name] += time.perf_counter() - t

    return run


def bare_fake(L: int, cache: bool = True, **widths: int) -> float:
    """The forward and backward of gpt2 (small, or ``widths``) on fake tensors with nothing recorded;
    ``cache=False``: FakeTensorMode's dispatch cache off (every op runs its meta kernel)."""
    with FakeTensorMode() as fake:
        fake.cache_enabled = cache
        model = GPT2(GPT2Config(n_layer=L, **widths))
        idx = torch.zeros(1, model.config.block_size, dtype=torch.long)
        t = time.perf_counter()
        model(idx, idx).backward()
        return time.perf_counter() - t


def bare_meta(L: int) -> float:
    """The same step on meta tensors, no mode: what FlopCounterMode's pass runs under its counting."""
    model = gpt2(L)
    with torch.device("meta"):
        idx = torch.zeros(1, model.config.block_size, dtype=torch.long)
    t = time.perf_counter()
    model(idx, idx).backward()
    return time.perf_counter() - t


FIRST = (4, 5, 4)  # the blocks of a first derive's traces: the probe, the check at other sizes, the user's model


def floor(repeats: int) -> None:
    """What a trace costs before symacct records anything: the floor under derive's three traces."""
    fresh = iter(range(13, 13 + 4 * repeats))  # heads: widths D = 64 H never traced before in the process

    def new_widths(L: int = 4) -> float:
        h = next(fresh)
        return bare_fake(L, n_embd=64 * h, n_head=h)

    rows = (
        ("FlopCounterMode pass on meta, L=12 (the yardstick)", lambda: flop_counter_pass(False)),
        ("meta tensors, no mode, L=12", lambda: bare_meta(12)),
        ("meta tensors, no mode, L=4", lambda: bare_meta(4)),
        ("fake tensors, L=4, widths traced before (dispatch cache hits)", lambda: bare_fake(4)),
        ("fake tensors, L=4, widths new to the process (first block misses)", new_widths),
        ("fake tensors, L=4, FakeTensorMode's dispatch cache off", lambda: bare_fake(4, cache=False)),
        ("fake tensors, a first derive's three traces: L=4, 5, 4 at new widths", lambda: sum(map(new_widths, FIRST))),
    )
    bare_fake(4)  # the cache filled for gpt2-small's widths
    print(f"\nthe floor: one forward+backward of gpt2, nothing recorded (median of {repeats})")
    for label, fn in rows:
        print(f"   {label:<72}{statistics.median(fn() for _ in range(repeats)):.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memo", action="store_true", help="the family memo on (the warm-up fills it): a second derive")
    ap.add_argument("--floor", action="store_true", help="only the floor: one step on meta and fake tensors")
    args = ap.parse_args()
    if args.floor:
        floor(args.repeats)
        return
    memo.FAMILIES.enabled = args.memo  # off by default: every trace taken, each stage timed
    symacct.derive(gpt2(2), optimizer=args.optimizer)  # warm-up: imports, rule tables, fake-tensor caches
    runs: list[dict[str, float]] = []
    totals = []
    for _ in range(args.repeats):
        table: dict[str, float] = defaultdict(float)
        saved = {name: getattr(DERIVE, name) for name, _ in STAGES}
        for name, fn in saved.items():
            setattr(DERIVE, name, _timed(table, name, fn))
        try:
            model = gpt2()
            t = time.perf_counter()
            symacct.derive(model, optimizer=args.optimizer)
            totals.append(time.perf_counter() - t)
        finally:
            for name, fn in saved.items():
                setattr(DERIVE, name, fn)
        runs.append(table)
    total = statistics.median(totals)
    fc = statistics.median(flop_counter_pass(bool(args.optimizer)) for _ in range(args.repeats))
    print(f"torch {torch.__version__}; gpt2-small (L=12) training step, optimizer={args.optimizer}, memo {args.memo}")
    print(f"derive: {total:.3f} s (median of {args.repeats}); FlopCounterMode pass on meta: {fc:.3f} s")
    print(f"ratio derive / FlopCounterMode: {total / fc:.2f}\n")
    print(f"{'stage':<24}{'s':>8}{'share':>8}  what")
    accounted = 0.0
    for name, what in STAGES:
        s = statistics.median(r[name] for r in runs)
        accounted += s
        print(f"{name:<24}{s:>8.3f}{s / total:>8.0%}  {what}")
    print(f"{'(rest)':<24}{total - accounted:>8.3f}{(total - accounted) / total:>8.0%}  probe choice, config reading")
    bare = {L: statistics.median(bare_fake(L) for _ in range(args.repeats)) for L in (4, 5)}
    print(f"\nbare fake-tensor forward+backward (nothing recorded): L=4 {bare[4]:.3f} s, L=5 {bare[5]:.3f} s")


if __name__ == "__main__":
    main()
