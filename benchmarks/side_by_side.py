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

from yardstick import derive_seconds, flop_counter_pass, gpt2

import symacct


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    symacct.derive(gpt2(2))
    symacct.derive(gpt2(2), optimizer="adamw")
    flop_counter_pass()
    fc, plain, adamw = [], [], []
    for _ in range(n):
        fc.append(flop_counter_pass())
        plain.append(derive_seconds(False))
        adamw.append(derive_seconds(True))
    f, d, a = (statistics.median(x) for x in (fc, plain, adamw))
    print(f"{symacct.__file__}: FlopCounterMode {f:.3f} s, derive {d:.3f} s ({d / f:.2f}x), "
          f"derive with AdamW + memory {a:.3f} s ({a / f:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
