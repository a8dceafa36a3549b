"""Sizes that are a symbol shifted by a constant: S - 1 (a shifted causal-LM loss), S_max + 2 (OPT's position
table). Before, they were read as constants at the probe (13 - 1 = 12) and refused by the second trace."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import symacct
from symacct import SymacctError
from symacct.measure import measure_memory, measure_step
from symacct.models import GPT2, GPT2Config
from symacct.probe import FIRST_PRIMES, OFFSETS, make_probe
from symacct.symbols import sym

SMALL = GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)


def shifted(logits: torch.Tensor) -> torch.Tensor:
    """Next-token loss as people write it: position t predicts token t+1 (targets all 0 here)."""
    B, S, V = logits.shape
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), torch.zeros(B * (S - 1), dtype=torch.long))  # (B*(S-1),)


def test_a_shifted_causal_lm_loss_is_exact():
    model = GPT2(SMALL)
    acct = symacct.derive(
        model, inputs=lambda m, B, S: (torch.randint(0, 32, (B, S)),), loss=shifted, optimizer="adamw"
    )
    B, S, V = sym("B"), sym("S"), sym("V")
    saved = sympy.Poly(acct.memory.activations, B, S, V)
    assert saved.coeff_monomial(B * V) == -4 and saved.coeff_monomial(B * S * V) == 4  # the (B*(S-1), V) log-softmax
    for b, s in ((2, 5), (3, 9)):
        torch.manual_seed(0)
        args = (torch.randint(0, 32, (b, s)),)
        at = acct.at(B=b, S=s)
        counted = measure_step(model, args, loss=shifted)
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes
        model.zero_grad(set_to_none=True)
        real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), loss=shifted)
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)
    with pytest.raises(SymacctError, match="1 <= S - 1"):  # one position has no next token
        acct.at(B=2, S=1)
    assert S in acct.memory.activations.free_symbols


@dataclass
class OPTLikeConfig:
    vocab_size: int = 40
    n_embd: int = 16
    max_position_embeddings: int = 20


class OPTLike(nn.Module):
    """OPT's learned positions: a table of S_max + 2 rows, indexed from 2."""

    def __init__(self, config: OPTLikeConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)  # (V, D)
        self.pos = nn.Embedding(config.max_position_embeddings + 2, config.n_embd)  # (S_max + 2, D)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # (D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, S = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(S) + 2)  # (B, S, D)
        return self.head(x).logsumexp(-1).mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab_size, (B, S)),)


def test_a_position_table_of_s_max_plus_2_rows():
    acct = symacct.derive(OPTLike(OPTLikeConfig()))
    D, V, S_max = sym("D"), sym("V"), sym("S_max")
    assert sympy.expand(acct.params - (D * V + D * (S_max + 2) + D * V)) == 0
    model = OPTLike(OPTLikeConfig())
    assert acct.at(B=1, S=4).params == sum(p.numel() for p in model.parameters())
    for b, s in ((2, 5), (3, 20)):
        torch.manual_seed(0)
        counted = measure_step(model, model.example_inputs(b, s))
        at = acct.at(B=b, S=s)
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes
    with pytest.raises(IndexError):  # positions 2 .. S+1 into S_max + 2 rows: S = 21 is one too many
        model(*model.example_inputs(1, 21))
    with pytest.raises(SymacctError, match=r"S \+ 2 <= S_max \+ 2"):
        acct.at(B=1, S=21)


def test_the_probe_reads_shifted_sizes_and_nothing_else():
    probe = make_probe(["B", "S", "D", "V"], FIRST_PRIMES, None, offsets=True)
    b, s, d = probe.values["B"], probe.values["S"], probe.values["D"]
    B, S, D = sym("B"), sym("S"), sym("D")
    assert probe.to_expr(s - 1) == S - 1
    assert sympy.expand(probe.to_expr(b * (s - 1)) - B * (S - 1)) == 0
    assert sympy.expand(probe.to_expr(4 * b * (s + 2) * d) - 4 * B * D * (S + 2)) == 0
    assert probe.to_expr(12) == 12 and probe.to_expr(b * s) == B * S  # constants and monomials as before
    assert probe.to_expr(s + 5) is None  # beyond the offsets: not read
    # every neighbour p + c of a first-probe prime carries a prime of no symbol: never a monomial by accident
    for p in FIRST_PRIMES:
        for c in OFFSETS:
            assert any(q > 7 and q not in FIRST_PRIMES for q in sympy.factorint(p + c)), (p, c)
