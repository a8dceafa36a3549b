"""A step that halves a width (``a, b = up(h).chunk(2, -1)``, a gated unit on one projection) cannot run at
the probe's prime widths: the halves of an odd width differ by one and do not broadcast. derive runs again
with the widths probed as 2 * prime, and a note says so. Before, the retry that followed kept every width
at its value: the formulas held only at the model's own widths. Exact against a real step at two sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from real_step import exact_against_a_real_step
from torch import nn

import symacct


@dataclasses.dataclass
class GatedConfig:
    vocab: int = 50
    width: int = 16
    ffn: int = 32  # the up projection's width: both halves of the gate
    n_layers: int = 2


class Gated(nn.Module):
    """A gated unit whose up projection is chunked in two: ffn/2 gated channels."""

    def __init__(self, c: GatedConfig) -> None:
        super().__init__()
        self.up = nn.Linear(c.width, c.ffn)
        self.down = nn.Linear(c.ffn // 2, c.width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, b = self.up(h).chunk(2, -1)  # (B, S, ffn/2) each
        return h + self.down(a * F.silu(b))  # (B, S, width)


class GatedLM(nn.Module):
    def __init__(self, config: GatedConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList([Gated(config) for _ in range(config.n_layers)])
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, S, width)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


def test_a_halved_width_is_probed_even_and_keeps_its_symbol() -> None:
    torch.manual_seed(0)
    model = GatedLM(GatedConfig())
    acct = symacct.derive(model, optimizer="adamw")
    assert "probed as 2 * prime" in acct.notes[0]
    assert {"ffn", "width", "vocab", "L"} <= set(acct.symbols)
    exact_against_a_real_step(model, acct)
    # the up projection (6 a multiply-add: forward and two backward products) and the down one, half as wide
    B, S, W, Fw, L = 2, 7, 16, 32, 2
    matmuls = 6 * B * S * W * Fw + 6 * B * S * (Fw // 2) * W
    head = 6 * B * S * W * 50
    assert acct.at(B=B, S=S).flops.hardware == L * matmuls + head  # the matmuls: the hardware count
    with pytest.raises(symacct.SymacctError):
        acct.at(B=B, S=S, ffn=33)  # an odd width: its halves are not whole


class Rotary(nn.Module):
    """A rotary-style table built each call from ``arange(0, width, 2)`` frequencies, ``cat([f, f])``: at an odd
    width it is one wider than the tensor it multiplies."""

    def __init__(self, c: GatedConfig) -> None:
        super().__init__()
        self.lin = nn.Linear(c.width, c.width)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, c.width, 2).float() / c.width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h (B, S, width)
        f = torch.outer(torch.arange(h.shape[1], dtype=h.dtype), self.inv_freq)  # (S, width/2)
        return h + self.lin(h * torch.cat([f, f], -1).cos())  # (B, S, width)


class RotaryLM(GatedLM):
    def __init__(self, config: GatedConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList([Rotary(config) for _ in range(config.n_layers)])


def test_a_rotary_table_one_wider_at_a_prime_width_is_probed_even() -> None:
    """The table's ceil(width/2) frequencies, doubled, are width + 1 wide at a prime width and fail to
    broadcast against the (B, S, width) tensor, in shapes of two ranks: the retry that probes the widths even
    did not recognise it (it compared shapes of one rank only), so the widths were kept at their values and
    the formulas held at the model's own width only. Exact against a real step, and at another width
    against a real step of a model that wide."""
    from symacct.measure.run import measure_step

    torch.manual_seed(0)
    acct = symacct.derive(RotaryLM(GatedConfig()), optimizer="adamw")
    assert "probed as 2 * prime" in acct.notes[0] and "width" in acct.symbols and not acct.tied
    exact_against_a_real_step(RotaryLM(GatedConfig()), acct)
    wide = RotaryLM(GatedConfig(width=24))
    counted = measure_step(wide, wide.example_inputs(2, 5))
    assert acct.at(B=2, S=5, width=24).flops.hardware == counted.flops_total
