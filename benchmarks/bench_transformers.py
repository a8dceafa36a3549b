"""Derive time of a transformers Llama-3-8B against the built-in llama at the same config, in one run;
and of a mixture of experts (Mixtral-8x7B) against the dense model with the same attention (Mistral-7B).

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
from symacct import memo
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


MIXTRAL_8X7B = {**LLAMA3_8B, "vocab_size": 32000, "max_position_embeddings": 32768}  # Mistral-7B's attention


def mixtral_model() -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("mixtral", num_local_experts=8, num_experts_per_tok=2, **MIXTRAL_8X7B)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def mistral_model() -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("mistral", sliding_window=None, **MIXTRAL_8X7B)
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
    memo.FAMILIES.enabled = False  # every derivation traced afresh, as these figures have always been (symacct.memo)
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    pairs = (
        ("transformers LlamaForCausalLM", hf_model, "built-in llama3-8b", builtin_model),
        ("Mixtral-8x7B (8 experts, top 2)", mixtral_model, "Mistral-7B (dense, same attention)", mistral_model),
    )
    for label, options in (("derive(model)", {}), ('derive(model, optimizer="adamw")', {"optimizer": "adamw"})):
        for name_a, make_a, name_b, make_b in pairs:
            times_a, times_b = [], []
            for _ in range(args.repeats):
                dt, acct_a = timed(make_a, **options)
                times_a.append(dt)
                dt, acct_b = timed(make_b, **options)
                times_b.append(dt)
            a, b = statistics.median(times_a), statistics.median(times_b)
            n_a = acct_a.at(B=1, S=4096).params  # type: ignore[attr-defined]
            n_b = acct_b.at(B=1, S=4096).params  # type: ignore[attr-defined]
            print(f"\n{label}, median of {args.repeats}")
            print(f"   {name_a:36s} {a:6.2f} s   params {n_a:,}")
            print(f"   {name_b:36s} {b:6.2f} s   params {n_b:,}")
            target = "  (target <= 2)" if make_b is builtin_model else ""
            print(f"   ratio: {a / b:.2f}{target}")


if __name__ == "__main__":
    main()
