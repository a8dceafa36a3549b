"""Serving derivations, side by side with the alternative (docs/benchmark-serving.txt).

1. derive(step="prefill") and derive(step="decode") of a Llama-3-8B config (bf16, on meta) against one
   FlopCounterMode pass of the same decode step on meta tensors at one context: the derivation gives the
   formulas in B and C, the pass one number; both are checked equal there.
2. serve(): the serving figures from the two derivations (the batch and context searches included).
3. The decode FLOPs at 20 contexts: the formula against 20 FlopCounterMode passes.

Every ratio is measured in one run on one machine; machines differ 3-4x in speed.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode
from yardstick import median_time

import symacct
from symacct import memo
from symacct.models.presets import PRESETS
from symacct.time.serving import serve


def decode_pass(model: torch.nn.Module, B: int, C: int) -> int:
    with torch.device("meta"):
        inputs = model.decode_inputs(B, 1, C)
        inputs["cache"] = [(k.bfloat16(), v.bfloat16()) for k, v in inputs["cache"]]
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(**inputs)
    return fc.get_total_flops()


def main() -> None:
    memo.FAMILIES.enabled = False  # every derivation traced afresh, as these figures have always been (symacct.memo)
    print(f"torch {torch.__version__}, symacct {symacct.__version__}")
    cls, make = PRESETS["llama3-8b"]
    with torch.device("meta"):
        model = cls(make()).to(torch.bfloat16).eval()

    def both() -> tuple:
        return (
            symacct.derive(model, step="prefill", params_dtype="bf16"),
            symacct.derive(model, step="decode", params_dtype="bf16"),
        )

    t_derive = median_time(both)
    prefill, decode = both()
    t_pass = median_time(lambda: decode_pass(model, 1, 8191))
    assert decode.at(B=1, C=8191).flops.forward == decode_pass(model, 1, 8191)
    print("\n1. Llama-3-8B (bf16, meta): derive prefill + decode vs one FlopCounterMode decode pass (meta)")
    print(
        f"   derive both: {t_derive:.2f} s; one decode pass at C=8191: {t_pass:.3f} s; ratio {t_derive / t_pass:.1f}x"
    )
    t_serve = median_time(lambda: serve(prefill, decode, hardware="H100-SXM", context=8192))
    print(f"\n2. serve() at context 8192 (searches included): {t_serve:.2f} s")
    contexts = [256 * (i + 1) for i in range(20)]
    t = time.perf_counter()
    values = [int(v) for v in decode.sweep("flops.forward", B=1, C=np.array(contexts))]
    t_eval = time.perf_counter() - t
    t = time.perf_counter()
    passes = [decode_pass(model, 1, c) for c in contexts]
    t_passes = time.perf_counter() - t
    assert values == passes
    print(
        f"\n3. decode FLOPs at 20 contexts: formula {t_eval:.3f} s, 20 passes {t_passes:.2f} s, ratio "
        f"{t_passes / t_eval:.1f}x; all equal"
    )


if __name__ == "__main__":
    main()
