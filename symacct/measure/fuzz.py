"""Random models for fuzzing derive against PyTorch's own counters.

A model is a stack of layers drawn from ``LAYERS``, each mapping a
(B, S, C) tensor to (B, S, C): Linear, an MLP, Conv1d and Conv2d, Embedding
(first layer, token inputs), LayerNorm / RMSNorm / BatchNorm, activations,
dropout, residual adds, attention written out and through SDPA, and
reshape / transpose / contiguous / cat / split. C and the layers' own sizes
are constants; B and S are the symbols. ``check`` derives the model and
compares, on a real CPU step, matmul FLOPs (FlopCounterMode, plus an
independent count of the CPU flash-attention kernel it misses) and
saved-activation bytes (saved_tensors_hooks), exactly; or reports the
documented ``SymacctError`` that derive raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from symacct.errors import SymacctError

LAYERS = (
    "linear", "mlp", "conv1d", "conv2d", "layernorm", "rmsnorm", "batchnorm", "relu", "gelu", "silu", "tanh",
    "dropout", "residual", "attention", "sdpa", "reshape", "cat_split",
)  # fmt: skip


class Layer(nn.Module):
    def __init__(self, kind: str, C: int) -> None:
        super().__init__()
        self.kind = kind
        self.C = C
        if kind in ("linear", "residual"):
            self.f = nn.Linear(C, C)
        elif kind == "mlp":
            self.f = nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))
        elif kind == "conv1d":
            self.f = nn.Conv1d(C, C, 3, padding=1)
        elif kind == "conv2d":
            self.f = nn.Conv2d(1, 2, 3, padding=1)
        elif kind == "layernorm":
            self.f = nn.LayerNorm(C)
        elif kind == "rmsnorm":
            self.f = nn.RMSNorm(C)
        elif kind == "batchnorm":
            self.f = nn.BatchNorm1d(C)
        elif kind == "dropout":
            self.f = nn.Dropout(0.1)
        elif kind in ("attention", "sdpa"):
            self.qkv = nn.Linear(C, 3 * C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, C)
        k, C = self.kind, self.C
        if k in ("linear", "mlp", "layernorm", "rmsnorm", "dropout"):
            return self.f(x)
        if k == "residual":
            return x + self.f(x)
        if k == "conv1d":
            return self.f(x.transpose(1, 2)).transpose(1, 2)  # (B, C, S) -> (B, S, C)
        if k == "conv2d":
            y = self.f(x.unsqueeze(1))  # (B, 2, S, C)
            return y.sum(1)  # (B, S, C)
        if k == "batchnorm":
            return self.f(x.transpose(1, 2)).transpose(1, 2)
        if k in ("relu", "gelu", "silu", "tanh"):
            return getattr(F, k)(x) if k != "tanh" else torch.tanh(x)
        if k in ("attention", "sdpa"):
            q, kk, v = self.qkv(x).split(C, dim=-1)  # 3 x (B, S, C)
            if k == "sdpa":
                return F.scaled_dot_product_attention(q[:, None], kk[:, None], v[:, None])[:, 0]  # (B, S, C)
            att = torch.softmax(q @ kk.transpose(1, 2) / math.sqrt(C), dim=-1)  # (B, S, S)
            return att @ v  # (B, S, C)
        if k == "reshape":
            B, S, _ = x.shape
            return x.transpose(0, 1).contiguous().view(S, B, C).transpose(0, 1)  # (B, S, C)
        if k == "cat_split":
            a, b = x.split([C // 2, C - C // 2], dim=-1)
            return torch.cat((b, a), dim=-1)  # (B, S, C)
        raise ValueError(k)


class FuzzModel(nn.Module):
    def __init__(self, kinds: list[str], C: int, vocab: int | None) -> None:
        super().__init__()
        self.C, self.vocab = C, vocab
        self.emb = nn.Embedding(vocab, C) if vocab else None
        self.layers = nn.ModuleList(Layer(k, C) for k in kinds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)  # (B, S, C)
        for layer in self.layers:
            x = layer(x)
        return x.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        if self.vocab:
            return (torch.randint(0, self.vocab, (B, S)),)
        return (torch.randn(B, S, self.C),)


class _CountCpuSdpa(TorchDispatchMode):
    """Independent count of the CPU flash-attention kernel's matmul FLOPs (FlopCounterMode counts 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            b, h, s, d = args[0].shape  # q: (B, H, S, D); QK^T and PV
            self.flops += 2 * (2 * b * h * s * s * d)
        elif name == "_scaled_dot_product_flash_attention_for_cpu_backward":
            b, h, s, d = args[1].shape  # scores again, dV, dP, dQ, dK
            self.flops += 5 * (2 * b * h * s * s * d)
        return func(*args, **(kwargs or {}))


@dataclass
class Outcome:
    status: str  # 'matched' | 'refused' (by design) | 'MISMATCH' | 'FAILED' (symacct's own defect)
    detail: str = ""


def check(kinds: list[str], C: int, vocab: int | None, sizes: list[tuple[int, int]]) -> Outcome:
    """Derive one random model and compare it with a real CPU step at each (B, S)."""
    from symacct.measure.run import measure_step
    from symacct.pipeline import derive

    torch.manual_seed(0)
    model = FuzzModel(kinds, C, vocab)
    try:
        acct = derive(model)
    except SymacctError as e:
        if e.internal:  # a rule that crashed, an exception symacct did not expect: a bug, never a pass
            return Outcome("FAILED", f"{kinds} C={C} vocab={vocab}: {e}")
        return Outcome("refused", str(e).split(".")[0])
    for B, S in sizes:
        torch.manual_seed(1)
        args = model.example_inputs(B, S)
        counter = _CountCpuSdpa()
        with counter:
            m = measure_step(model, args)
        model.zero_grad(set_to_none=True)
        at = acct.at(B=B, S=S)
        want = (m.flops_total + counter.flops, m.saved_bytes)
        got = (at.flops.hardware, at.memory.activations)
        if got != want:
            return Outcome("MISMATCH", f"{kinds} C={C} vocab={vocab} B={B} S={S}: derived {got}, counted {want}")
    return Outcome("matched")


def random_spec(rng: Any) -> tuple[list[str], int, int | None]:
    """A random (kinds, C, vocab) from a ``random.Random``."""
    n = rng.randint(1, 6)
    kinds = [rng.choice(LAYERS) for _ in range(n)]
    C = rng.choice([2, 4, 6, 8, 10, 12])
    vocab = rng.choice([None, None, 17, 50])
    return kinds, C, vocab


def main(argv: list[str] | None = None) -> int:
    """``python -m symacct.measure.fuzz --n 2000``: the thorough profile, with counts and reasons."""
    import argparse
    import collections
    import random
    import time

    ap = argparse.ArgumentParser(prog="python -m symacct.measure.fuzz")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    mismatches = []
    t0 = time.perf_counter()
    for _ in range(args.n):
        kinds, C, vocab = random_spec(rng)
        sizes = [(rng.randint(2, 5), rng.randint(2, 9)) for _ in range(2)]
        out = check(kinds, C, vocab, sizes)
        counts[out.status] += 1
        if out.status == "refused":
            reasons[out.detail] += 1
        elif out.status in ("MISMATCH", "FAILED"):
            mismatches.append(f"{out.status} {out.detail}")
    print(
        f"generated {args.n} models in {time.perf_counter() - t0:.0f} s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    for reason, n in reasons.most_common():
        print(f"  refused {n}: {reason}")
    for m in mismatches:
        print(f"  {m}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
