"""derive beside one FlopCounterMode pass of the same gpt2-small step (L=12) on meta tensors, in one process.

Medians of N rounds of {FlopCounterMode pass, derive, derive with AdamW and the memory pass}, after a
warm-up. Run it for another version of symacct by putting a copy of that checkout first on the path
(an old checkout needs its ``models/`` copied to ``symacct/models``):

    python benchmarks/side_by_side.py [N]
    PYTHONPATH=/tmp/old-copy python benchmarks/side_by_side.py [N]

docs/profile-derive.md quotes its output, before and after, run one after the other.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import symacct
import symacct.pipeline  # noqa: F401  the package's names load on first use: loaded before any timer
from symacct.models import GPT2, GPT2Config


def gpt2(L: int = 12) -> GPT2:
    with torch.device("meta"):
        return GPT2(GPT2Config(n_layer=L))


def flop_counter_pass() -> float:
    model = gpt2()
    with torch.device("meta"):
        idx = torch.zeros(1, model.config.block_size, dtype=torch.long)
    t = time.perf_counter()
    with FlopCounterMode(display=False):
        model(idx, idx).backward()
    return time.perf_counter() - t


def derive(optimizer: str | None) -> float:
    model = gpt2()
    t = time.perf_counter()
    symacct.derive(model, optimizer=optimizer)  # the memory pass (liveness, the peak) is part of every derive
    return time.perf_counter() - t


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    symacct.derive(gpt2(2))
    symacct.derive(gpt2(2), optimizer="adamw")
    flop_counter_pass()
    fc, plain, adamw = [], [], []
    for _ in range(n):
        fc.append(flop_counter_pass())
        plain.append(derive(None))
        adamw.append(derive("adamw"))
    f, d, a = (statistics.median(x) for x in (fc, plain, adamw))
    print(f"{symacct.__file__}: FlopCounterMode {f:.3f} s, derive {d:.3f} s ({d / f:.2f}x), "
          f"derive with AdamW + memory {a:.3f} s ({a / f:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
