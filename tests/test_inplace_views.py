"""An in-place op on a view in the forward (``symacct.trace.views``): the view's backward node is
``AsStridedBackward0`` on a real tensor, a replay of the view on a fake one; the real one makes a zeroed
buffer the size of the base, which the trace now makes too. Each view kind, exact against a real step; before,
the peak of an instance-norm block with an in-place LeakyReLU was short by one activation map."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from real_step import exact_against_a_real_step
from torch import nn

import symacct

VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # (B, S, 4W) -> a view changed in place
    "view": lambda y: y.view(y.shape[0], y.shape[1], 4, -1),
    "flatten": lambda y: y.flatten(0, 1),
    "transpose": lambda y: y.transpose(1, 2),
    "permute": lambda y: y.permute(2, 0, 1),
    "unsqueeze": lambda y: y.unsqueeze(0),
    "slice": lambda y: y[:, :, : y.shape[2] // 2],
    "select": lambda y: y[:, 0],
}


@dataclasses.dataclass
class ViewsConfig:
    vocab: int = 50
    width: int = 16
    view: str = "view"


class ChangedView(nn.Module):
    """A linear layer to 4W, one of ``VIEWS`` of its output changed in place by ReLU (and read again), a linear
    layer back."""

    def __init__(self, config: ViewsConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        u = self.up(self.emb(x)) * 2  # (B, S, 4W), no leaf
        w = VIEWS[self.config.view](u).relu_()  # read again below: its node runs in the backward
        return F.cross_entropy(self.down(u).flatten(0, 1), y.flatten()) + w.mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_view_changed_in_place_is_exact(view: str) -> None:
    torch.manual_seed(0)
    model = ChangedView(ViewsConfig(view=view))
    exact_against_a_real_step(model, symacct.derive(model, optimizer="adamw"), points=((2, 8), (3, 12)))


@dataclasses.dataclass
class NormConfig:
    width: int = 8
    num_classes: int = 10
    n_layers: int = 2


class NormAct(nn.Module):
    """Residual blocks of a convolution, ``nn.InstanceNorm2d`` (whose output is a view of a batch norm's) and
    an in-place LeakyReLU, as image-to-image generators stack them."""

    def __init__(self, config: NormConfig) -> None:
        super().__init__()
        self.config = config
        W = config.width
        self.stem = nn.Conv2d(3, W, 3, padding=1)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Conv2d(W, W, 3, padding=1), nn.InstanceNorm2d(W, affine=True), nn.LeakyReLU(0.2, True))
                for _ in range(config.n_layers)
            ]
        )
        self.head = nn.Linear(W, config.num_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)  # (B, W, S, S)
        for block in self.blocks:
            h = h + block(h)  # (B, W, S, S)
        return F.cross_entropy(self.head(h.mean((2, 3))), y)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(B, 3, S, S), torch.randint(0, self.config.num_classes, (B,))


def test_instance_norm_with_an_in_place_activation_is_exact() -> None:
    torch.manual_seed(0)
    model = NormAct(NormConfig())
    exact_against_a_real_step(model, symacct.derive(model, optimizer="adamw"), points=((2, 16), (3, 24)))
