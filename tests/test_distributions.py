"""``torch.distributions`` in the forward (a VAE's reparameterised sample and its KL term). A distribution
checks its arguments by reading their values (``validate_args``, on by default), which fake tensors cannot
answer: refused, naming that check and how to turn it off (before, a generic "replace the value-dependent
branch"); with the check off, exact against a real step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from real_step import exact_against_a_real_step
from torch import nn

import symacct


@dataclasses.dataclass
class VAEConfig:
    vocab: int = 40
    width: int = 16
    validate_args: bool | None = None  # the distribution's (None: PyTorch's default, on)


class VAE(nn.Module):
    """A Gaussian latent per position: mean and log-variance heads, a reparameterised sample, the KL term."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.mu = nn.Linear(config.width, config.width)
        self.logvar = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, S, W)
        mu, logv = self.mu(h), self.logvar(h)  # (B, S, W) each
        q = torch.distributions.Normal(mu, (0.5 * logv).exp(), validate_args=self.config.validate_args)
        z = q.rsample()  # (B, S, W)
        kl = -0.5 * (1 + logv - mu.pow(2) - logv.exp()).sum(-1).mean()
        return z.square().mean() + kl

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_distribution_checking_its_arguments_is_refused_with_the_way_out() -> None:
    with pytest.raises(symacct.SymacctError, match="torch.distributions checks") as e:
        symacct.derive(VAE(VAEConfig()))
    assert "validate_args=False" in e.value.hint


def test_a_distribution_without_the_check_is_exact_against_a_real_step() -> None:
    torch.manual_seed(0)
    model = VAE(VAEConfig(validate_args=False))
    exact_against_a_real_step(model, symacct.derive(model, optimizer="adamw"))
