"""Derive speed, memory, and formula sweeps against FlopCounterMode, in one run.

Prints, with medians over repeats (this machine is shared and noisy):

0. derive of a gpt2-small training step (L=12) beside one FlopCounterMode
   pass of the same step on meta tensors, measured in the same process: the
   first of each in a fresh process (cold: nothing cached), and the median of
   repeats after a warm-up derive of another size (warm: PyTorch's fake-tensor
   dispatch cache, symacct's rule caches and its family memo filled, as in a
   sweep, a planner or a second command; the user's model is still traced
   and compared every time: symacct.memo), the same at widths not traced
   before in the process (D = 64 H, H = 13, 14, ...: the user's trace then
   misses the fake-tensor cache for its first block, beside FlopCounterMode
   passes at those widths), and the same with the memo off
   (every trace taken); with AdamW and the memory pass beside the FlopCounterMode pass of
   the step with AdamW and beside the plain one (every derive runs the memory
   pass: liveness, phase points, the peak);
1. derive time of a gpt2 training step at L = 2, 12, 96, the memo off (derive
   traces probe models, so it must not grow with L) and the L=96 / L=2 ratio;
2. peak RSS of deriving a Llama-3-405B config (in a fresh subprocess), and
   derive with AdamW and memory (liveness, peak) for a Llama-3-70B config;
3. a sweep of N random (B, S, D, L) gpt2 configs: the derived formula
   evaluated with numpy (acct.sweep) vs FlopCounterMode running each step on
   meta tensors, with the ratio; every swept value is checked equal.

    python benchmarks/bench_derive.py [--n 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode
from yardstick import timed

import symacct
from symacct import memo
from symacct.models import GPT2, GPT2Config

SIDE_BY_SIDE = """
import statistics, sys
sys.path.insert(0, {here!r})
import symacct
from symacct import memo
from yardstick import derive_seconds, flop_counter_pass, gpt2

adamw = {adamw}
cold = (flop_counter_pass(False), flop_counter_pass(True), derive_seconds(adamw))
symacct.derive(gpt2(2), optimizer="adamw" if adamw else None)
runs = (lambda: flop_counter_pass(False), lambda: flop_counter_pass(True), lambda: derive_seconds(adamw))
warm = [statistics.median(f() for _ in range({repeats})) for f in runs]
fresh = [dict(n_embd=64 * h, n_head=h) for h in range(13, 13 + {repeats})]  # widths not traced before
widths = [derive_seconds(adamw, **w) for w in fresh]
widths_fc = [flop_counter_pass(False, **w) for w in fresh] + [flop_counter_pass(True, **w) for w in fresh]
new = (statistics.median(widths_fc[:len(fresh)]), statistics.median(widths_fc[len(fresh):]), statistics.median(widths))
memo.FAMILIES.enabled = False
traced = statistics.median(derive_seconds(adamw) for _ in range({repeats}))
print(*cold, *warm, traced, *new)
"""

RSS_CHILD = """
import resource, time, torch, symacct
import symacct.pipeline  # the package's names load on first use: loaded before the timer
from symacct.models.presets import PRESETS
cls, make = PRESETS["{name}"]
with torch.device("meta"):
    model = cls(make())
t = time.perf_counter()
acct = symacct.derive(model, optimizer={optimizer!r})
dt = time.perf_counter() - t
print(dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def gpt2(L: int, **kw: int) -> GPT2:
    cfg = GPT2Config(n_layer=L, **kw)
    with torch.device("meta"):
        return GPT2(cfg)


def time_derive(L: int, repeats: int) -> float:
    """The median time of a derive with every trace taken (the family memo off: symacct.memo)."""
    memo.FAMILIES.enabled = False
    times = []
    for _ in range(repeats):
        model = gpt2(L)
        with timed() as seconds:
            symacct.derive(model)
        times.append(seconds())
    memo.FAMILIES.enabled = True
    return statistics.median(times)


def rss_of(name: str, optimizer: str | None = None) -> tuple[float, float]:
    code = RSS_CHILD.format(name=name, optimizer=optimizer)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    dt, kb = out.stdout.split()
    return float(dt), int(kb) / 1024


def flop_counter_meta(B: int, S: int, D: int, L: int) -> int:
    cfg = GPT2Config(n_layer=L, n_embd=D, n_head=4, vocab_size=512, block_size=S, dropout=0.0)
    with torch.device("meta"):
        model = GPT2(cfg)
        idx = torch.zeros(B, S, dtype=torch.long)
    with FlopCounterMode(display=False) as fc:
        model(idx, idx).backward()
    return fc.get_total_flops()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, symacct {symacct.__version__}")

    print("\n0. derive vs one FlopCounterMode pass of the same gpt2-small step (L=12) on meta tensors")
    for adamw in (False, True):
        code = SIDE_BY_SIDE.format(here=str(Path(__file__).parent), adamw=adamw, repeats=args.repeats)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        c_fc, c_fca, c_d, w_fc, w_fca, w_d, t_d, n_fc, n_fca, n_d = (float(x) for x in out.stdout.split())
        what = "derive with AdamW" if adamw else "derive"
        target = 2.0 if adamw else 1.0
        rows = (
            ("cold (fresh process)", c_fc, c_fca, c_d),
            ("warm, the family memoised (median)", w_fc, w_fca, w_d),
            ("warm, the family memoised, widths new to the process (median)", n_fc, n_fca, n_d),
            ("warm, memo off: every trace taken (median)", w_fc, w_fca, t_d),
        )
        for label, fc, fca, d in rows:
            line = f"   {what}, {label}: {d:.3f} s; FlopCounterMode {fc:.3f} s -> {d / fc:.2f}x (target <= {target})"
            if adamw:
                line += f"; vs its pass with AdamW {fca:.3f} s -> {d / fca:.2f}x"
            print(line)

    print("\n1. derive time, gpt2 training step (median of", args.repeats, "runs)")
    t = {L: time_derive(L, args.repeats) for L in (2, 12, 96)}
    for L, s in t.items():
        print(f"   L={L:<3} {s:.3f} s")
    print(
        f"   ratio L=96 / L=2: {t[96] / t[2]:.2f}  (target <= 1.2; L=2 traces two blocks of the user's model, L>4 four)"
    )
    print(f"   ratio L=96 / L=12: {t[96] / t[12]:.2f}")

    print("\n2. peak RSS of one derive in a fresh process")
    for name in ("gpt2", "llama3-70b", "llama3-405b"):
        dt, mb = rss_of(name)
        print(f"   {name:<12} derive {dt:.2f} s, peak RSS {mb:.0f} MiB")

    print("\n2b. derive with AdamW and the memory pass (liveness, peak), fresh process each, median of", args.repeats)
    for name in ("gpt2", "llama3-70b"):
        runs = [rss_of(name, "adamw") for _ in range(args.repeats)]
        dt = statistics.median(r[0] for r in runs)
        mb = max(r[1] for r in runs)
        print(f"   {name:<12} derive+memory {dt:.2f} s, peak RSS {mb:.0f} MiB  (70B target <= 3 s, < 1.5 GB)")

    print(f"\n3. sweep of {args.n} random gpt2 configs (B, S, D, L); V=512, H=4")
    rng = random.Random(0)
    cfgs = [(rng.randint(1, 16), rng.randint(8, 256), 4 * rng.randint(2, 64), rng.randint(1, 8)) for _ in range(args.n)]
    B, S, D, L = (np.array(c) for c in zip(*cfgs))
    acct = symacct.derive(gpt2(2, n_head=4, vocab_size=512, dropout=0.0))
    sweeps = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        got = acct.sweep("flops.total", B=B, S=S, D=D, L=L, H=4, V=512, S_max=S)
        sweeps.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    counted = [flop_counter_meta(*c) for c in cfgs]
    t_fc = time.perf_counter() - t0
    assert [int(x) for x in got] == counted, "formula and FlopCounterMode disagree"
    t_sw = statistics.median(sweeps)
    print(f"   derived formula (numpy): {t_sw * 1e3:.2f} ms  (median of {args.repeats})")
    print(f"   FlopCounterMode on meta: {t_fc:.1f} s  (one pass)")
    print(f"   all {args.n} values equal; ratio {t_fc / t_sw:,.0f}x  (target >= 200x)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"   (peak RSS of this process {rss:.0f} MiB)")


if __name__ == "__main__":
    main()
