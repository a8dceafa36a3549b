"""Two config fields that read as one letter by name, with different values.

``block_size`` is nanoGPT's context length, so it reads as S_max; so does ``max_seq_len``. MiniMax's config
has both (``block_size``, 256, its linear attention's chunk; ``max_position_embeddings``), and so do BigBird's
and Pegasus-X's (a sparse-attention block). One symbol cannot be two sizes: the field listed first in
``symacct.symbols.ALIASES`` keeps the letter, the other is a symbol of its own name, with a note. Equal
values still share the letter (CodeGen's ``n_positions`` and ``n_ctx``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from real_step import exact_against_a_real_step

import symacct


@dataclasses.dataclass
class _ChunkConfig:
    width: int = 8
    max_seq_len: int = 24  # the position table's rows
    block_size: int = 16  # a chunk's length: the decay buffer's side


class _Chunked(torch.nn.Module):
    """Learned positions (max_seq_len rows), and a decay buffer of block_size x block_size (MiniMax's lightning
    attention keeps such a buffer for the positions of one chunk), read whole."""

    def __init__(self, config: _ChunkConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = torch.nn.Linear(config.width, config.width)
        self.pos = torch.nn.Parameter(torch.randn(config.max_seq_len, config.width))
        self.register_buffer("decay", torch.tril(torch.ones(config.block_size, config.block_size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, width)
        h = self.proj(x + self.pos[: x.shape[1]])  # (B, S, width)
        return h.square().mean() + self.decay.mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_two_fields_named_as_one_size_are_two_symbols() -> None:
    """Before, both were S_max and probed as one size: the rebuilt model's table and buffer had one side, and
    derive refused the model as not the one given. (MiniMax, below, came out silently wrong: its buffers'
    bytes at max_position_embeddings' value, 64, not block_size's, 256.)"""
    model = _Chunked(_ChunkConfig())
    acct = symacct.derive(model, optimizer="adamw")
    assert acct.symbols == {"S_max": 24, "block_size": 16, "width": 8}
    assert any(
        "block_size = 16, max_seq_len = 24 read as one size, S_max, by name: max_seq_len is S_max" in n
        for n in acct.notes
    )
    exact_against_a_real_step(model, acct, points=[(2, 7), (3, 11)])
    assert acct.at(B=2, S=7).memory.buffers == 16 * 16 * 4


def test_two_fields_named_as_one_size_with_one_value_stay_one_symbol() -> None:
    model = _Chunked(_ChunkConfig(max_seq_len=16))
    acct = symacct.derive(model, optimizer="adamw")
    assert "S_max" in acct.symbols and "block_size" not in acct.symbols
    assert "block_size = 16, max_seq_len = 16 read as one size, S_max, by name: one symbol" in " ".join(acct.notes)
    exact_against_a_real_step(model, acct, points=[(2, 7), (3, 11)])


def test_minimax_keeps_max_position_embeddings_as_s_max() -> None:
    """MiniMax's block_size (256, its lightning attention's chunk) sizes three buffers a linear-attention layer;
    read as S_max, they were evaluated at max_position_embeddings (64): memory after the forward came out
    989,184 bytes low, silently. Exact now, block_size a symbol of its own."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = T.MiniMaxConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = T.MiniMaxForCausalLM(config)
    acct = symacct.derive(model, optimizer="adamw")
    assert acct.symbols["block_size"] == 256 and acct.symbols["S_max"] == 64
    from test_transformers import check_exact

    check_exact(model, acct, [(2, 7), (3, 11)])
