"""The seed's MLP "cruncher": ``L`` Linear layers D x D, then a D x 1 head.

The loss is the mean of the scalar outputs (the seed's toy objective), so
one training step needs only the float inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class CruncherConfig:
    dim: int = 64  # D: width of every hidden layer
    n_layers: int = 2  # L: number of D x D layers


class Cruncher(nn.Module):
    def __init__(self, config: CruncherConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(nn.Linear(config.dim, config.dim, bias=False) for _ in range(config.n_layers))
        self.final = nn.Linear(config.dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, D)
        for layer in self.layers:
            x = layer(x)  # (B, D)
        y = self.final(x)  # (B, 1)
        return y.mean()  # scalar loss

    def example_inputs(self, B: int, S: int = 1) -> tuple[torch.Tensor]:
        """Inputs of one step: ``x`` of shape (B, D). ``S`` is unused."""
        return (torch.randn(B, self.config.dim),)
