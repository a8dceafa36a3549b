"""The ResNet reference model (strided convolutions, max pooling, batch norm, global pooling, a classifier)
is exact against the counters: matmul FLOPs (convolutions) against FlopCounterMode, saved bytes against
saved_tensors_hooks, parameters, and the memory phases and peak against a real step with AdamW.

The image side S is halved five times: the formulas hold where 32 divides S, which derive learns from
the trace (the sizes S/32 it reads) and enforces."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from real_step import exact_against_a_real_step

import symacct
from symacct import SymacctError
from symacct.measure.run import measure_memory, measure_step
from symacct.models import ResNet, ResNetConfig
from symacct.symbols import sym


@settings(max_examples=min(settings.default.max_examples, 3), phases=[Phase.explicit, Phase.generate])
@given(
    width=st.integers(2, 6),
    classes=st.integers(2, 12),
    channels=st.integers(2, 3),
    blocks=st.sampled_from([(1, 1, 1, 1), (2, 2, 2, 2), (1, 2, 1, 1)]),
    batch=st.integers(2, 3),
    sides=st.sampled_from([(32, 64), (64, 96)]),
)
def test_resnet_is_exact(width, classes, channels, blocks, batch, sides):
    torch.manual_seed(0)
    model = ResNet(ResNetConfig(width=width, num_classes=classes, blocks=blocks, channels=channels))
    acct = symacct.derive(model, optimizer="adamw")
    for B, S in ((batch, sides[0]), (batch + 1, sides[1])):
        args = model.example_inputs(B, S)
        at = acct.at(B=B, S=S)
        counted = measure_step(model, args)
        model.zero_grad(set_to_none=True)
        assert (at.flops.forward, at.flops.backward) == (counted.flops_forward, counted.flops_backward)
        assert at.memory.activations == counted.saved_bytes
        assert at.params == sum(p.numel() for p in model.parameters())
        real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        assert (at.memory.after_forward, at.memory.after_backward, at.memory.peak) == (
            real.after_forward,
            real.after_backward,
            real.peak,
        )
        model.zero_grad(set_to_none=True)


def test_resnet_formulas_are_in_the_image_side_and_refuse_other_sides():
    acct = symacct.derive(ResNet(ResNetConfig(width=4, num_classes=10)))
    S, width = sym("S"), sym("width")
    assert S in acct.flops.total.free_symbols and width in acct.flops.total.free_symbols
    assert acct.flops.forward.as_poly(S).degree() == 2  # convolutions over S x S pixels
    acct.at(B=2, S=224)  # 32 * 7
    with pytest.raises(SymacctError, match="32 divides S|divides S"):
        acct.at(B=2, S=200)


class UpDown(torch.nn.Module):
    """A small U-Net: down by a strided convolution and a pool, up by nearest upsampling and a transposed
    convolution, a skip joined by ``cat``, group norm (the upsampling had no cost rule: refused before)."""

    def __init__(self, config: UpDownConfig) -> None:
        super().__init__()
        nn = torch.nn
        self.config = config
        C = config.channels
        self.inc = nn.Conv2d(config.in_channels, C, 3, padding=1)
        self.down = nn.Conv2d(C, 2 * C, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 2 * C)
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(2 * C, 2 * C, 3, padding=1)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.up = nn.ConvTranspose2d(2 * C, C, 2, stride=2)
        self.outc = nn.Conv2d(2 * C, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        a = F.silu(self.inc(x))  # (B, C, S, S)
        b = F.gelu(self.norm(self.down(a)))  # (B, 2C, S/2, S/2)
        m = F.relu(self.mid(self.pool(b)))  # (B, 2C, S/4, S/4)
        u = self.up(self.upsample(m))  # (B, C, S, S)
        return self.outc(torch.cat([a, u], 1)).square().mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.in_channels, S, S),)


@dataclasses.dataclass
class UpDownConfig:
    channels: int = 8
    image_size: int = 16  # S
    in_channels: int = 3


def test_a_network_that_upsamples_is_exact():
    torch.manual_seed(0)
    model = UpDown(UpDownConfig())
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct, [(2, 16), (3, 32)])


class Padded(torch.nn.Module):
    """Convolutions padded by reflection (2-d) and replication (3-d over a depth of 2), upsampled bilinearly and
    by a pixel shuffle, trained on the mean squared error to the input (as an autoencoder): the padding kernels,
    the interpolation, the shuffle and the loss had no cost rule (refused before)."""

    def __init__(self, config: UpDownConfig) -> None:
        super().__init__()
        nn = torch.nn
        self.config = config
        C = config.channels
        self.mid = nn.Conv3d(config.in_channels, C, 3, padding=1, padding_mode="replicate")
        self.enc = nn.Conv2d(C, C, 3, stride=2, padding=1, padding_mode="reflect")
        self.dec = nn.Conv2d(C, config.in_channels, 3, padding=1, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        h = self.mid(torch.stack([x, x], 2)).mean(2)  # (B, in, 2, S, S) -> (B, C, S, S)
        h = F.silu(self.enc(h))  # (B, C, S/2, S/2)
        h = F.interpolate(h, scale_factor=2, mode="bilinear")  # (B, C, S, S)
        y = F.pixel_shuffle(F.pixel_unshuffle(self.dec(h), 2), 2)  # (B, 4 in, S/2, S/2) -> (B, in, S, S)
        return F.mse_loss(y, x)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.in_channels, S, S),)


def test_padding_modes_interpolation_and_a_shuffle_are_exact():
    from symacct.cost.graph import records

    torch.manual_seed(0)
    model = Padded(UpDownConfig())
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct, [(2, 16), (3, 32)])
    # padding's backward adds each gradient element into its source: one FLOP per element of the padded input
    B, S, C = sym("B"), sym("S"), sym("channels")
    pads: dict[str, object] = {}
    for _, n in records(acct.graph):
        if "_pad" in n.op:
            name = n.op.split(".")[1]
            pads[name] = pads.get(name, 0) + n.cost.flops_other * n.count
    # (the replication padding pads the input, which needs no gradient: it has no backward)
    assert set(pads) == {"replication_pad3d", "reflection_pad2d", "reflection_pad2d_backward"}
    assert pads["reflection_pad2d"] == pads["replication_pad3d"] == 0
    want = 2 * B * C * (S + 2) ** 2  # the gradients of dec's padded input, then enc's
    got = pads["reflection_pad2d_backward"]
    assert (got - want).expand() == 0, got


@dataclasses.dataclass
class PooledConfig:
    channels: int = 8
    classes: int = 10
    ceil_mode: bool = False


class Pooled(torch.nn.Module):
    """Pooling by function calls only (``F.max_pool2d``, ``F.avg_pool2d``): no module tells derive that the image
    side is halved, so its first probe at an odd side does not divide (refused before, "not a product of the
    model's symbols"); derive then probes the side as 64 * prime, as for pooling modules."""

    def __init__(self, config: PooledConfig) -> None:
        super().__init__()
        self.config = config
        self.conv = torch.nn.Conv2d(3, config.channels, 3, padding=1)
        self.head = torch.nn.Linear(config.channels, config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        h = F.max_pool2d(F.relu(self.conv(x)), 2, ceil_mode=self.config.ceil_mode)  # (B, C, S/2, S/2)
        h = F.avg_pool2d(h, 2)  # (B, C, S/4, S/4)
        return F.cross_entropy(self.head(h.mean((2, 3))), torch.zeros(x.shape[0], dtype=torch.long))

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, 3, S, S),)


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_functional_pooling_is_probed_at_even_sides_and_exact(ceil_mode):
    torch.manual_seed(0)
    model = Pooled(PooledConfig(ceil_mode=ceil_mode))
    acct = symacct.derive(model, optimizer="adamw")
    assert any("F.max_pool2d" in n or "max_pool2d" in n for n in acct.notes)
    exact_against_a_real_step(model, acct, [(2, 16), (3, 36)])
    with pytest.raises(SymacctError, match="divides S"):  # an odd side pools to other sizes: refused
        acct.at(B=2, S=30)


@dataclasses.dataclass
class PooledSequenceConfig:
    width: int = 8
    max_len: int = 64  # S_max: the position table's rows


class PooledSequence(torch.nn.Module):
    """Learned positions, then the sequence halved by ``F.avg_pool1d`` (a funnel's downsampling): derive probes
    S as 64 * prime again, and the position table's S_max with it (it must stay longer than S). Before, that
    probe failed inside symacct ("S_max must exceed S", reported as a defect of symacct)."""

    def __init__(self, config: PooledSequenceConfig) -> None:
        super().__init__()
        self.config = config
        self.pos = torch.nn.Parameter(torch.randn(config.max_len, config.width))
        self.proj = torch.nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, width)
        h = self.proj(x + self.pos[: x.shape[1]])  # (B, S, width)
        h = torch.nn.functional.avg_pool1d(h.transpose(1, 2), 2)  # (B, width, S/2)
        return h.square().mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_a_halved_sequence_is_probed_at_even_lengths_below_its_table() -> None:
    torch.manual_seed(0)
    model = PooledSequence(PooledSequenceConfig())
    acct = symacct.derive(model, optimizer="adamw")
    assert any("avg_pool2d" in n for n in acct.notes)  # avg_pool1d runs as avg_pool2d on the CPU
    exact_against_a_real_step(model, acct, [(2, 16), (3, 36)])
