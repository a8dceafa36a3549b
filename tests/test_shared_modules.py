"""A module instance shared by the blocks of a layer stack: one activation passed to every block (OpenAI GPT's
``gelu_new`` is one module-level instance, shared by every block of every model in the process), a
parameterless helper built once and handed down.

The recorder named such a module as ``torch.distributed._tools.ModTracker`` does, by its last parent: every
block's call of it counted in the last block. The blocks then differed, and derive refused the model as
"not the model given" (L = 2, 3) or as formulas that "do not predict a second trace" (L = 6). A module is now
named as the child of the module calling it, so each block's call is that block's. Exact against a real step
at three depths, the layer stack factored, each block's call in its own block.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from real_step import exact_against_a_real_step
from torch import nn

import symacct

SHARED = nn.GELU(approximate="tanh")  # one instance for every model, as transformers' OpenAI GPT has it


@dataclasses.dataclass
class SharedConfig:
    vocab_size: int = 50
    n_embd: int = 16
    n_layer: int = 2
    per_model: bool = False  # one instance a model (built in __init__) rather than one for the process


class Block(nn.Module):
    def __init__(self, c: SharedConfig, act: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.proj = nn.Linear(4 * c.n_embd, c.n_embd)
        self.act = act  # the same instance in every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act(self.fc(x)))  # (B, S, n_embd)


class SharedLM(nn.Module):
    def __init__(self, config: SharedConfig) -> None:
        super().__init__()
        self.config = config
        act = nn.GELU(approximate="tanh") if config.per_model else SHARED
        self.emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config, act) for _ in range(config.n_layer)])
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, S, n_embd)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab_size
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


@pytest.mark.parametrize(("L", "per_model"), [(2, False), (3, True), (6, False)])
def test_an_activation_shared_by_every_block_is_each_blocks_own(L: int, per_model: bool) -> None:
    torch.manual_seed(0)
    model = SharedLM(SharedConfig(n_layer=L, per_model=per_model))
    assert model.blocks[0].act is model.blocks[-1].act
    acct = symacct.derive(model, optimizer="adamw")
    assert "L" in {str(s) for s in acct.flops.total.free_symbols}
    exact_against_a_real_step(model, acct)
    # each block's call in its own block: the GELU writes its output (B, S, 4 D) forward and its input's
    # gradient backward, fp32, in every one of the L blocks
    B, S, D = 2, 7, 16
    values = {"B": B, "S": S, "D": D, "L": L, "V": 50}
    written = acct.modules["blocks.*.act"]["bytes_written"]
    assert written.subs({s: values[str(s)] for s in written.free_symbols}) == L * 2 * B * S * 4 * D * 4
