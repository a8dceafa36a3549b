"""PyTorch's own ``nn.TransformerEncoder``, derived and measured on a real step.

Three ways it went wrong before: it did not build on fake tensors (its layer clones are deep copies, which
PyTorch makes in a fake mode of their own); a post-norm stack's saved activations missed the last block's
output, which the head saves and the blocks before it do not; and in inference, the step ran the unfused
path on fake tensors (symacct's ``torch.device`` context made every tensor "have a torch function") where the
model run eagerly takes PyTorch's fused kernel, so the figures were another path's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from real_step import POINTS, exact_against_a_real_step
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct import SymacctError
from symacct.measure.run import CpuFlashCounter, measure_memory


@dataclasses.dataclass
class EncoderConfig:
    vocab_size: int = 50  # V
    d_model: int = 16  # D
    n_head: int = 4  # H
    n_layer: int = 2  # L
    dim_feedforward: int = 24  # a width of its own
    norm_first: bool = False
    batch_first: bool = True


class Encoder(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` (no dropout, no final norm) and a vocabulary head."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        layer = nn.TransformerEncoderLayer(
            c.d_model, c.n_head, c.dim_feedforward, dropout=0.0, batch_first=c.batch_first, norm_first=c.norm_first
        )
        self.enc = nn.TransformerEncoder(layer, c.n_layer, enable_nested_tensor=False)
        self.out = nn.Linear(c.d_model, c.vocab_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x)  # (B, S, D)
        h = self.enc(h) if self.config.batch_first else self.enc(h.transpose(0, 1)).transpose(0, 1)
        logits = self.out(h)  # (B, S, V)
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab_size
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


def ids(model: Encoder, B: int, S: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, model.config.vocab_size, (B, S)),)


@pytest.mark.parametrize(("norm_first", "batch_first"), [(False, True), (True, True), (False, False)])
def test_a_training_step_is_exact(norm_first: bool, batch_first: bool) -> None:
    torch.manual_seed(0)
    model = Encoder(EncoderConfig(norm_first=norm_first, batch_first=batch_first))
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)


class CausalEncoder(Encoder):
    """A causal mask given as PyTorch's tutorial gives it: made by ``generate_square_subsequent_mask``, no
    ``is_causal``; the encoder reads it (``mask == its own causal mask``) and runs SDPA causal."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x)  # (B, S, D)
        h = self.enc(h, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))
        logits = self.out(h)  # (B, S, V)
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


class ConvertingEncoder(Encoder):
    """A constructor that converts its submodules with ``Module.to``, as DeepSeek V4's keeps its norms in
    float32: a no-op conversion (the norm) and a real one (the head in float64, fed a float64 input)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        self.norm = nn.LayerNorm(config.d_model).to(dtype=torch.float32)
        self.out = self.out.to(torch.float64)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.out(self.norm(self.enc(self.emb(x))).double())  # (B, S, V) in float64
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_a_constructor_that_converts_a_submodule_is_built_and_exact() -> None:
    """On fake tensors ``Module.to`` swaps every parameter for its converted copy, which a fake tensor's weakref
    forbids ("Couldn't swap"), so the model could not be built at probe sizes: it is built on the meta device
    instead, where the conversion runs as on the CPU, and copied to fake tensors."""
    torch.manual_seed(0)
    model = ConvertingEncoder(EncoderConfig())
    assert model.out.weight.dtype == torch.float64
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)


class EncoderDecoder(nn.Module):
    """``nn.Transformer`` (its constructor initialises the clones of its layers), a causal target mask."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = c = config
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        self.tr = nn.Transformer(c.d_model, c.n_head, c.n_layer, c.n_layer, c.dim_feedforward, 0.0, batch_first=True)
        self.out = nn.Linear(c.d_model, c.vocab_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)  # (B, S, D)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.tr(e, e, tgt_mask=mask, tgt_is_causal=True)  # (B, S, D)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    example_inputs = Encoder.example_inputs


@pytest.mark.parametrize("cls", [CausalEncoder, EncoderDecoder])
def test_a_causal_mask_and_nn_transformer_are_exact(cls: type[nn.Module]) -> None:
    """Before: the mask comparison was a value read, refused; nn.Transformer did not build on fake tensors."""
    torch.manual_seed(0)
    model = cls(EncoderConfig(norm_first=cls is EncoderDecoder))
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)


def test_the_fused_inference_path_is_refused_and_the_unfused_one_exact() -> None:
    torch.manual_seed(0)
    model = Encoder(EncoderConfig())
    with pytest.raises(SymacctError, match="fused inference path of nn.TransformerEncoderLayer"):
        symacct.derive(model, step="forward", inputs=ids)
    with torch.device("meta"):  # a caller's device context does not hide the path either
        with pytest.raises(SymacctError, match="fused inference path"):
            symacct.derive(model, step="forward", inputs=ids)
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        acct = symacct.derive(model, step="forward", inputs=ids)
        model.eval()
        for B, S in POINTS:
            at = acct.at(B=B, S=S)
            args = ids(model, B, S)
            with torch.no_grad(), FlopCounterMode(display=False) as fc, CpuFlashCounter() as flash:
                model(*args)
            assert at.flops.hardware == fc.get_total_flops() + flash.total
            real = measure_memory(model, args, step="forward")
            assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


class _HandAttention(nn.Module):
    """Single-head attention written by hand (matmuls, softmax), masked causally or not at all."""

    def __init__(self, d_model: int, causal: bool) -> None:
        super().__init__()
        self.d_model, self.causal = d_model, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, D)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, S, D)
        scores = q @ k.transpose(1, 2) / self.d_model**0.5  # (B, S, S)
        if self.causal:
            S = x.shape[1]
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ v).square().mean()  # (B, S, D) -> ()


@pytest.mark.parametrize(
    "cls, discounted",
    [(Encoder, 0), (CausalEncoder, 1), (EncoderDecoder, 1)],  # attention stacks discounted: the decoder's own
)
def test_the_causal_discount_halves_causal_attention_only(cls: type[nn.Module], discounted: int) -> None:
    """``causal_discount=True`` halved every attention's score matmuls: a bidirectional encoder's too (its
    queries see every key, none of the work is masked). Now attention that runs neither causal nor masked is
    counted in full, and a note names it: each causal stack of L layers loses 6*B*D*L*S**2 (half its score
    and value matmuls, forward and backward), nn.Transformer only its decoder's self-attention."""
    import sympy

    from symacct.symbols import sym

    model = cls(EncoderConfig(norm_first=cls is EncoderDecoder))
    plain = symacct.derive(model)
    half = symacct.derive(model, causal_discount=True)
    B, S, D, L = (sym(n) for n in "BSDL")
    assert sympy.expand(plain.flops.total - half.flops.total - discounted * 6 * B * D * L * S**2) == 0
    named = [n for n in half.notes if n.startswith("causal_discount:")]
    assert bool(named) is (cls is not CausalEncoder)


@pytest.mark.parametrize("causal", [False, True])
def test_the_causal_discount_reads_a_hand_written_mask(causal: bool) -> None:
    """Attention written as matmuls: scores that reach their softmax with no mask are bidirectional."""
    import sympy

    from symacct.symbols import sym

    def inputs(m: nn.Module, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, m.d_model),)

    derive = dict(dims={"d_model": 16}, inputs=inputs)
    plain = symacct.derive(lambda d_model: _HandAttention(d_model, causal), **derive)
    half = symacct.derive(lambda d_model: _HandAttention(d_model, causal), causal_discount=True, **derive)
    B, S, D = sym("B"), sym("S"), sym("D")
    assert sympy.expand(plain.flops.total - half.flops.total - (6 * B * D * S**2 if causal else 0)) == 0
