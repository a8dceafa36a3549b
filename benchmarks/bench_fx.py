"""torch.fx interop, side by side with the alternative (docs/benchmark-fx.txt).

1. ``symacct.annotate`` on a torch.export program of a gpt2-small forward (L=12, dynamic B and S) against
   FlopCounterMode running the same exported module once on fake inputs at one size: annotate gives the
   FLOPs as a formula in B and S, the count one number; both are checked equal at that size.
2. The formula evaluated at N sizes against N FlopCounterMode passes.
3. ``acct.fx`` (the derived step written as a GraphModule) against the derive it comes from.

Every ratio is measured in one run on one machine; machines differ 3-4x in speed.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim, export
from torch.utils.flop_counter import FlopCounterMode
from yardstick import median_time

import symacct
from symacct import memo
from symacct.models import GPT2, GPT2Config
from symacct.symbols import sym


def count(module: torch.nn.Module, B: int, S: int, vocab: int) -> int:
    with FakeTensorMode(allow_non_fake_inputs=True):
        idx = torch.randint(0, vocab, (B, S))
        with FlopCounterMode(display=False) as fc:
            module(idx, idx)
    return fc.get_total_flops()


def main() -> None:
    memo.FAMILIES.enabled = False  # every derivation traced afresh, as these figures have always been (symacct.memo)
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=20, help="sizes for section 2")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, symacct {symacct.__version__}")

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, block_size=1024, dropout=0.0)
    torch.manual_seed(0)
    model = GPT2(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    B, S = Dim("B"), Dim("S", max=cfg.block_size - 1)
    t = time.perf_counter()
    program = export(model, (idx, idx), dynamic_shapes=({0: B, 1: S}, {0: B, 1: S}))
    t_export = time.perf_counter() - t
    module = program.module()

    print("\n1. gpt2-small forward (L=12), exported with dynamic B and S")
    print(f"   torch.export itself (for reference, once): {t_export:.2f} s")
    t_ann = median_time(lambda: symacct.annotate(program), args.repeats)
    t_fc = median_time(lambda: count(module, 8, 960, cfg.vocab_size), args.repeats)
    costs = symacct.annotate(program)
    at = int(costs.flops.xreplace({sym("B"): 8, sym("S"): 960}))
    counted = count(module, 8, 960, cfg.vocab_size)
    assert at == counted, (at, counted)
    print(f"   annotate (formula in B, S): {t_ann:.3f} s  (median of {args.repeats})")
    print(f"   FlopCounterMode, one pass at B=8, S=960: {t_fc:.3f} s")
    print(f"   ratio annotate / one pass: {t_ann / t_fc:.2f}x; equal at B=8, S=960: {at:,} FLOPs")

    print(f"\n2. the FLOPs at {args.n} sizes (B, S)")
    sizes = [(1 + i % 8, 64 * (1 + i % 15)) for i in range(args.n)]
    f = costs.flops
    t = time.perf_counter()
    values = [int(f.xreplace({sym("B"): b, sym("S"): s})) for b, s in sizes]
    t_eval = time.perf_counter() - t
    t = time.perf_counter()
    passes = [count(module, b, s, cfg.vocab_size) for b, s in sizes]
    t_passes = time.perf_counter() - t
    assert values == passes
    once = t_ann + t_eval
    print(f"   annotate once + {args.n} evaluations: {once:.3f} s; {args.n} FlopCounterMode passes: {t_passes:.2f} s")
    print(f"   ratio: {t_passes / once:.1f}x faster, all {args.n} values equal")

    print("\n3. acct.fx: the derived gpt2-small training step as a GraphModule")
    t_derive = median_time(lambda: symacct.derive(model), args.repeats)
    acct = symacct.derive(model)
    t_fx = median_time(lambda: acct.fx, args.repeats)
    print(
        f"   derive: {t_derive:.3f} s; acct.fx: {t_fx:.3f} s ({t_fx / t_derive:.2f}x of the derive), "
        f"{len(acct.fx.graph.nodes)} fx nodes"
    )


if __name__ == "__main__":
    main()
