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
from symacct.measure.run import measure_memory, measure_step
from symacct.models import GPT2, GPT2Config
from symacct.symbols import sym
from symacct.trace.probe import FIRST_PRIMES, OFFSETS, make_probe

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
    # beyond the offsets: never read as S + 5 (a constant it may factor into is refused by the second trace)
    assert probe.to_expr(s + 5) != S + 5
    # every neighbour p + c of a first-probe prime carries a prime of no symbol: never a monomial by accident
    for p in FIRST_PRIMES:
        for c in OFFSETS:
            assert any(q > 7 and q not in FIRST_PRIMES for q in sympy.factorint(p + c)), (p, c)


@dataclass
class FusedConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2


class FusedAttention(nn.Module):
    """One projection for q, k and v with grouped heads (Phi-3, GPT-NeoX style): (H + 2*H_kv)*Dh outputs."""

    def __init__(self, c: FusedConfig) -> None:
        super().__init__()
        self.H, self.H_kv = c.num_attention_heads, c.num_key_value_heads
        self.dh = c.hidden_size // self.H
        self.qkv = nn.Linear(c.hidden_size, (self.H + 2 * self.H_kv) * self.dh, bias=False)  # (D, (H+2H_kv)Dh)
        self.o = nn.Linear(self.H * self.dh, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).split([self.H * self.dh, self.H_kv * self.dh, self.H_kv * self.dh], dim=-1)
        q = q.view(B, S, self.H, self.dh).transpose(1, 2)  # (B, H, S, Dh)
        k = k.view(B, S, self.H_kv, self.dh).transpose(1, 2)  # (B, H_kv, S, Dh)
        v = v.view(B, S, self.H_kv, self.dh).transpose(1, 2)  # (B, H_kv, S, Dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, S, Dh)
        return self.o(y.transpose(1, 2).reshape(B, S, D))  # (B, S, D)


class Fused(nn.Module):
    def __init__(self, config: FusedConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(FusedAttention(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)  # (B, S, D)
        return x.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.hidden_size),)


def test_a_fused_qkv_projection_with_grouped_heads():
    """(H + 2*H_kv)*D/H is not a product of symbols; read as D/H times (H + 2*H_kv). Exact: FlopCounterMode
    plus the CPU flash kernel it counts 0 (4*B*H*S*S*Dh forward, 10*... backward), saved bytes, parameters."""
    acct = symacct.derive(Fused(FusedConfig()))
    D, H, H_kv, L = sym("D"), sym("H"), sym("H_kv"), sym("L")
    assert sympy.expand(acct.params - L * (D * (H + 2 * H_kv) * D / H + D * D)) == 0
    for cfg, b, s in ((FusedConfig(), 2, 5), (FusedConfig(48, 6, 3, 3), 3, 7)):
        torch.manual_seed(0)
        model = Fused(cfg)
        counted = measure_step(model, model.example_inputs(b, s))
        h, dh, n = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
        one = 2 * b * h * s * s * dh
        at = acct.at(B=b, S=s, D=cfg.hidden_size, H=h, H_kv=cfg.num_key_value_heads, L=n)
        assert at.params == sum(p.numel() for p in model.parameters())
        assert at.flops.forward == counted.flops_forward + n * 2 * one
        assert at.flops.hardware == counted.flops_total + n * 7 * one
        assert at.memory.activations == counted.saved_bytes


@dataclass
class RotaryConfig:
    n_embd: int = 32
    n_head: int = 2
    n_layer: int = 2


class PartialRotary(nn.Module):
    """GPT-NeoX's partial rotary embedding: a quarter of each head's width is rotated (rotary_pct = 0.25)."""

    def __init__(self, config: RotaryConfig) -> None:
        super().__init__()
        self.config = config
        self.H, self.dh = config.n_head, config.n_embd // config.n_head
        self.rot = int(self.dh * 0.25)  # Dh/4 rotated dimensions
        self.layers = nn.ModuleList(nn.Linear(config.n_embd, config.n_embd, bias=False) for _ in range(config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        angle = torch.arange(S)[:, None] * torch.ones(self.rot // 2)  # (S, Dh/8)
        cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()  # (S, Dh/4)
        for layer in self.layers:
            q = layer(x).view(B, S, self.H, self.dh)  # (B, S, H, Dh)
            q_rot, q_pass = q[..., : self.rot], q[..., self.rot :]  # (B, S, H, Dh/4), (B, S, H, 3Dh/4)
            half = torch.cat((-q_rot[..., self.rot // 2 :], q_rot[..., : self.rot // 2]), -1)
            q_rot = q_rot * cos[:, None] + half * sin[:, None]
            x = torch.cat((q_rot, q_pass), -1).reshape(B, S, D)  # (B, S, D)
        return x.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.n_embd),)


def test_partial_rotary_widths_are_read():
    """A quarter of the head width (D/(4H)) and its half: the probe's head width is a multiple of 8."""
    acct = symacct.derive(PartialRotary(RotaryConfig()))
    for cfg, b, s in ((RotaryConfig(), 2, 5), (RotaryConfig(64, 4, 3), 3, 6)):
        torch.manual_seed(0)
        model = PartialRotary(cfg)
        counted = measure_step(model, model.example_inputs(b, s))
        at = acct.at(B=b, S=s, D=cfg.n_embd, H=cfg.n_head, L=cfg.n_layer)
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes
    with pytest.raises(SymacctError, match="divides D"):  # a head width of 12 has no whole eighth
        acct.at(B=1, S=4, D=24, H=2)


def test_a_head_less_a_kept_width_is_read_as_such():
    """``cuts``: a width kept at its value (a rotary part of 64) makes the head prime one whose width less 64
    keeps a prime above 7, and ``X - 64`` a reading; without, 8 * 29 - 64 = 168 is a plain constant."""
    plain = make_probe(["B", "S", "H", "D"], FIRST_PRIMES, None, offsets=True)
    head = plain.values["D"] // plain.values["H"]
    assert head == 8 * 29 and plain.to_expr(head - 64) == 168  # the misreading the cut avoids
    probe = make_probe(["B", "S", "H", "D"], FIRST_PRIMES, None, offsets=True, cuts=(64,))
    head = probe.values["D"] // probe.values["H"]
    assert head == 8 * 19  # 8 * 29 - 64 = 2**3 * 3 * 7 and 8 * 23 - 64 = 2**3 * 3 * 5: 19 leaves 11
    D, H, B = sym("D"), sym("H"), sym("B")
    assert probe.to_expr(head - 64) == D / H - 64
    assert sympy.expand(probe.to_expr(probe.values["B"] * (head - 64)) - B * (D / H - 64)) == 0
    assert probe.to_expr(head) == D / H and probe.to_expr(64) == 64  # the head and the kept part as before


def test_the_reading_in_the_fewest_symbols_is_taken():
    """D + 2*D/H (a multi-query QKV width) equals 3*D/(8*H) * (S + V) at the first probe: the reading in fewer
    symbols wins over the one with the smaller constant."""
    probe = make_probe(["B", "S", "H", "D", "V"], FIRST_PRIMES, None, offsets=True)
    D, H, S, V = (probe.values[n] for n in ("D", "H", "S", "V"))
    assert 3 * D // (8 * H) * (S + V) == D + 2 * D // H  # the coincidence at these primes
    got = probe.to_expr(D + 2 * D // H)
    assert sympy.expand(got - (sym("D") + 2 * sym("D") / sym("H"))) == 0
