"""Derive time of a transformers Llama-3-8B against the built-in llama at the same config, in one run.

Both are built on the meta device and derived with ``symacct.derive(model)``
(and again with ``optimizer="adamw"``); medians over repeats, each repeat
alternating the two so that machine noise hits both alike. The ratio is the
figure to quote (machines differ 3-4x in speed). The parameter counts are
printed too: the two models are the same network.

    python benchmarks/bench_transformers.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import symacct
from symacct.models.presets import PRESETS

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def hf_model() -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("llama", **LLAMA3_8B)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def builtin_model() -> torch.nn.Module:
    cls, make = PRESETS["llama3-8b"]
    with torch.device("meta"):
        return cls(make())


def timed(make: object, **options: object) -> tuple[float, object]:
    model = make()  # type: ignore[operator]
    t = time.perf_counter()
    acct = symacct.derive(model, **options)
    return time.perf_counter() - t, acct


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for label, options in (("derive(model)", {}), ('derive(model, optimizer="adamw")', {"optimizer": "adamw"})):
        hf, builtin = [], []
        for _ in range(args.repeats):
            dt, acct_hf = timed(hf_model, **options)
            hf.append(dt)
            dt, acct_builtin = timed(builtin_model, **options)
            builtin.append(dt)
        a, b = statistics.median(hf), statistics.median(builtin)
        n_hf = acct_hf.at(B=1, S=8192).params  # type: ignore[attr-defined]
        n_builtin = acct_builtin.at(B=1, S=8192).params  # type: ignore[attr-defined]
        print(f"\n{label}, median of {args.repeats}")
        print(f"   transformers LlamaForCausalLM  {a:6.2f} s   params {n_hf:,}")
        print(f"   built-in llama3-8b             {b:6.2f} s   params {n_builtin:,}")
        print(f"   ratio transformers / built-in: {a / b:.2f}  (target <= 2)")


if __name__ == "__main__":
    main()
