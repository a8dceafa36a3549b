"""Low precision: autocast, bf16 parameters, inference. Every figure against a real CPU step, exactly.

- autocast bf16 training (AdamW): matmul FLOPs (FlopCounterMode), saved bytes
  (saved_tensors_hooks: autocast's bf16 weight copies are saved, and counted),
  params / grads / optimizer bytes, the three phase points and the peak;
- bf16 inference (``step="forward"``, ``params_dtype=torch.bfloat16``):
  2 bytes per parameter, and the transient peak.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import sympy
import torch
from cases import _SMALL, build, gpt2_cases, llama_cases, sizes, switches
from hypothesis import given
from real_step import exact_against_a_real_step

import symacct
from symacct.measure.run import measure_memory, measure_step
from symacct.models import GPT2, GPT2Config


@cache
def _derive(kind, sw, **kw) -> symacct.Accounting:
    return symacct.derive(build(dataclasses.replace(_SMALL[kind], **dict(sw))), **kw)


def autocast_acct(cfg) -> symacct.Accounting:
    return _derive(type(cfg), switches(cfg), autocast=torch.bfloat16, optimizer="adamw")


def inference_acct(cfg) -> symacct.Accounting:
    return _derive(type(cfg), switches(cfg), step="forward", params_dtype=torch.bfloat16)


def check_autocast(case) -> None:
    cfg, B, S = case
    acct = autocast_acct(cfg).at(B=B, S=S, **sizes(cfg))
    torch.manual_seed(0)
    model = build(cfg)
    args = model.example_inputs(B, S)
    counted = measure_step(model, args, autocast=torch.bfloat16)
    extra = 0
    if getattr(cfg, "sdpa", False) and getattr(cfg, "dropout", 0.0) == 0.0:
        # FlopCounterMode counts the CPU flash kernel as 0 (see test_flops_exact.py)
        s = sizes(cfg)
        extra = (7 + 2 * cfg.checkpoint) * s["L"] * 2 * B * s["H"] * S * S * (s["D"] // s["H"])
    assert acct.flops.hardware == counted.flops_total + extra
    assert acct.memory.activations == counted.saved_bytes
    real = measure_memory(
        build(cfg), args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), autocast=torch.bfloat16
    )
    got = acct.memory
    assert (got.params, got.grads, got.optimizer) == (real.params, real.grads, real.optimizer)
    assert (got.after_forward, got.after_backward, got.after_optimizer, got.peak) == (
        real.after_forward,
        real.after_backward,
        real.after_optimizer,
        real.peak,
    )


def check_inference(case) -> None:
    cfg, B, S = case
    acct = inference_acct(cfg).at(B=B, S=S, **sizes(cfg))
    model = build(cfg).to(torch.bfloat16)
    real = measure_memory(model, model.example_inputs(B, S), step="forward")
    assert acct.memory.params == real.params
    assert (acct.memory.after_forward, acct.memory.peak) == (real.after_forward, real.peak)


@given(gpt2_cases(lo=2))
def test_gpt2_autocast_bf16(case):
    check_autocast(case)


@pytest.mark.slow  # a derivation more of a path the default run also covers: in CI's slow pass (20 minutes)
@given(llama_cases(lo=2))
def test_llama_autocast_bf16(case):
    check_autocast(case)


@given(gpt2_cases(lo=2))
def test_gpt2_bf16_inference(case):
    check_inference(case)


@given(llama_cases(lo=2))
def test_llama_bf16_inference(case):
    check_inference(case)


def test_bf16_inference_is_two_bytes_per_parameter():
    acct = symacct.derive(
        GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)),
        step="forward",
        params_dtype=torch.bfloat16,
    )
    assert sympy.expand(acct.memory.params - 2 * acct.params) == 0
    assert acct.memory.grads == 0 and acct.memory.optimizer == 0


def test_autocast_weight_copies_are_saved_per_layer():
    """Under autocast the bf16 copies of the 12 D^2 block weights are saved for backward: 24 D^2 bytes per layer."""
    acct = symacct.derive(
        GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)), autocast=torch.bfloat16
    )
    D = sympy.Symbol("D", integer=True, positive=True)
    per_layer = acct.memory.activations_per_layer["blocks"]
    assert sympy.Poly(per_layer, D).coeff_monomial(D**2) == 24
    # and they appear as what they are, per module: one bf16 copy (2 bytes an element) of weight and bias
    copies = acct.memory.autocast_copies
    L = sympy.Symbol("L", integer=True, positive=True)
    assert sympy.expand(copies["blocks.*.attn.c_attn"] - L * 2 * (3 * D * D + 3 * D)) == 0
    assert sympy.expand(copies["blocks.*.mlp.c_fc"] - L * 2 * (4 * D * D + 4 * D)) == 0
    fp32 = symacct.derive(GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)))
    assert fp32.memory.autocast_copies == {}
    assert sympy.Poly(fp32.memory.activations_per_layer["blocks"], D).coeff_monomial(D**2) == 0


@dataclasses.dataclass
class NormsConfig:
    vocab: int = 50
    width: int = 16
    bf16_inside: bool = False  # cast to bf16 in forward, the norms' parameters float32; else under autocast


class Norms(torch.nn.Module):
    """Group, batch and layer norm on a bfloat16 input with float32 parameters: the CPU's mixed kernels return
    their statistics in float32 (PyTorch's meta kernels say bfloat16), and group norm's backward returns the
    input's gradient in bfloat16 (its meta kernel says float32, and autograd would add a cast the real step
    does not run). Batch norm is the one of them that CPU autocast leaves uncast."""

    def __init__(self, config: NormsConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = torch.nn.Embedding(config.vocab, config.width)
        self.lin = torch.nn.Linear(config.width, config.width)
        self.gn = torch.nn.GroupNorm(4, config.width)
        self.bn = torch.nn.BatchNorm1d(config.width)
        self.ln = torch.nn.LayerNorm(config.width)
        self.out = torch.nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(x))  # (B, S, W)
        if self.config.bf16_inside:
            h = h.to(torch.bfloat16)
        h = h.transpose(1, 2)  # (B, W, S)
        h = self.bn(h) + (self.gn(h) if self.config.bf16_inside else 0)
        h = self.ln(h.transpose(1, 2)) if self.config.bf16_inside else torch.relu(h.transpose(1, 2))
        logits = self.out(h.float() if self.config.bf16_inside else h)  # (B, S, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, self.config.vocab, (B, S)), torch.randint(0, self.config.vocab, (B, S))


@pytest.mark.parametrize("bf16_inside", [False, True], ids=["autocast", "cast-in-forward"])
def test_mixed_precision_norms_hold_what_the_cpu_kernels_return(bf16_inside):
    model = Norms(NormsConfig(bf16_inside=bf16_inside))
    autocast = None if bf16_inside else "bf16"
    acct = symacct.derive(model, optimizer="adamw", autocast=autocast)
    exact_against_a_real_step(model, acct, [(2, 9), (3, 13)], autocast=None if bf16_inside else torch.bfloat16)
