"""Ops that had no cost rule: a spectral norm's matrix-vector products (``mv``, ``vdot``), a running
``logcumsumexp``, a vector read off or written onto a diagonal (``diagonal``'s backward, ``diag_embed``),
``Tensor.unfold``'s backward and ``index_add``. A model using them derives, exact against a real step, and
each kernel costs what docs/conventions.md says, counted here by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import sympy
import torch
from real_step import exact_against_a_real_step
from torch import nn

import symacct
from symacct.cost.graph import records
from symacct.symbols import sym


@dataclasses.dataclass
class ScansConfig:
    vocab: int = 50
    width: int = 16


class Scans(nn.Module):
    """A spectrally normalised linear layer, a cumulative log-sum-exp over the sequence, and the diagonal of a
    (B, S, S) product read off and a vector written onto one."""

    def __init__(self, config: ScansConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(config.width, config.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(x))  # (B, S, W)
        c = torch.logcumsumexp(h, dim=1)  # (B, S, W)
        a = c @ h.transpose(1, 2)  # (B, S, S)
        return torch.diagonal(a, dim1=1, dim2=2).mean() + torch.diag_embed(c[..., 0]).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_matvec_scans_and_diagonals_are_exact_against_a_real_step() -> None:
    torch.manual_seed(0)
    model = Scans(ScansConfig())
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)

    B, S, W = sym("B"), sym("S"), sym("width")
    want = {  # (phase, op): (FLOPs, bytes read, bytes written), summed over the op's nodes; float32
        # the power iteration (one, in train mode): v = W^T u, u = W v, then sigma = u . (W v)
        ("forward", "mv"): (3 * 2 * W**2, 3 * (4 * W**2 + 4 * W), 3 * 4 * W),
        ("forward", "vdot"): (2 * W, 2 * 4 * W, 4),
        ("forward", "logcumsumexp"): (6 * B * S * W, 4 * B * S * W, 4 * B * S * W),
        # its gradient runs it twice, on flipped tensors
        ("backward", "logcumsumexp"): (2 * 6 * B * S * W, 2 * 4 * B * S * W, 2 * 4 * B * S * W),
        # a (B, S) vector onto the diagonal of a zeroed (B, S, S) matrix
        ("forward", "diag_embed"): (0, 4 * B * S, 4 * B * S * S),
        ("backward", "diagonal_backward"): (0, 4 * B * S, 4 * B * S * S),
    }
    got = _summed(acct, want, ("flops_other", "bytes_read", "bytes_written"), no_matmul=True)
    assert set(got) == set(want)
    for key, expected in want.items():
        assert all(sympy.expand(g - e) == 0 for g, e in zip(got[key], expected)), (key, got[key])


def _summed(
    acct: symacct.Accounting, keys: Iterable[tuple[str, str]], fields: tuple[str, ...], no_matmul: bool = False
) -> dict[Any, Any]:
    """(phase, op name) -> each cost field times the node's count, summed over the op's nodes, for ``keys``;
    ``no_matmul``: none of them may have matmul FLOPs (FlopCounterMode counts them as 0)."""
    keys, got = set(keys), {}
    for _, n in records(acct.graph):
        key = (n.phase, n.op.split(".")[1] if n.op.startswith("aten.") else n.op)
        if key in keys:
            before = got.get(key, (0,) * len(fields))
            got[key] = tuple(b + getattr(n.cost, f) * n.count for b, f in zip(before, fields))
            assert not no_matmul or n.cost.flops == 0, key
    return got


class Windows(Scans):
    """Overlapping windows of the sequence (``Tensor.unfold``, a view, whose backward adds them back) and rows
    added at indices (``index_add``), after a plain linear layer."""

    def __init__(self, config: ScansConfig) -> None:
        super().__init__(config)
        self.lin = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(x))  # (B, S, W)
        w = h.unfold(1, 2, 1)  # (B, S - 1, W, 2): windows of 2 positions, step 1
        added = torch.zeros_like(h).index_add(1, torch.arange(h.shape[1]).flip(0), h)  # (B, S, W)
        return w.square().mean() + added.square().mean()


def test_unfolded_windows_and_index_add_are_exact_against_a_real_step() -> None:
    torch.manual_seed(0)
    model = Windows(ScansConfig())
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)
    B, S, W = sym("B"), sym("S"), sym("width")
    want = {  # one add per element of the source (index_add) or of the gradient read (unfold_backward)
        ("forward", "index_add"): B * S * W,
        ("backward", "unfold_backward"): B * (S - 1) * W * 2,
    }
    got = {k: v for k, (v,) in _summed(acct, want, ("flops_other",)).items()}
    assert set(got) == set(want)
    assert all(sympy.expand(got[k] - v) == 0 for k, v in want.items()), got
