"""Closed forms from the papers come out of derive as symbolic identities.

The reference formulas are typed here from the papers (see
../shared/REFERENCES.md), never copied from the engine's output.
"""

from __future__ import annotations

import sympy
import torch

import symacct
from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
from symacct.models.presets import PRESETS
from symacct.symbols import B, D, F, H, H_kv, L, S, S_max, V


def test_gpt2_untied_matmul_flops_are_korthikanti_appendix_a():
    # Korthikanti et al. 2022, appendix A: 72 b s L h^2 (1 + s/(6h) + v/(12 h L)), with h = D
    ref = 72 * B * S * L * D**2 * (1 + S / (6 * D) + V / (12 * D * L))
    acct = symacct.derive(
        GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16, tie_weights=False))
    )
    assert sympy.expand(acct.flops.total - ref) == 0
    # the form of the same identity
    assert sympy.expand(acct.flops.total - (L * (72 * B * S * D**2 + 12 * B * S**2 * D) + 6 * B * S * D * V)) == 0


def test_forward_is_a_third_of_the_step_for_gpt2():
    # Kaplan et al. 2020: backward = 2 x forward for the matmul family
    acct = symacct.derive(GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16, sdpa=True)))
    assert sympy.expand(acct.flops.backward - 2 * acct.flops.forward) == 0


def test_gpt2_small_parameter_count():
    # GPT-2 small with biases, tied head, 1024 positions: 124,439,808
    with torch.device("meta"):
        model = GPT2(GPT2Config())
    acct = symacct.derive(model)
    assert acct.at(B=1, S=1).params == 124_439_808
    # and the formula: embeddings (V + S_max) D, per layer 12 D^2 + 13 D, final LayerNorm 2 D
    assert sympy.expand(acct.params - ((V + S_max) * D + L * (12 * D**2 + 13 * D) + 2 * D)) == 0


def test_llama2_7b_parameter_count():
    # Llama 2 7B: 6,738,415,616 parameters
    with torch.device("meta"):
        model = Llama(LlamaConfig())
    assert symacct.derive(model).at(B=1, S=1).params == 6_738_415_616


def test_llama_params_formula_with_gqa():
    # per layer: wq, wo D^2 each; wk, wv D * D*H_kv/H each; SwiGLU 3 D F; two RMSNorm D
    ref = L * (2 * D**2 + 2 * D**2 * H_kv / H + 3 * D * F + 2 * D) + 2 * V * D + D
    cls, make = PRESETS["llama3-8b"]
    with torch.device("meta"):
        acct = symacct.derive(cls(make()))
    assert sympy.expand(acct.params - ref) == 0


def test_llama_matmul_flops_from_the_definition():
    # 2 per multiply-add, 3x forward for training: projections 2BS(D*D + 2*D*D*Hkv/H + D*D),
    # SwiGLU 2BS*3DF, scores and PV 2 * 2*B*H*S^2*(D/H), head 2BSDV
    fwd = L * (2 * B * S * (2 * D**2 + 2 * D**2 * H_kv / H) + 2 * B * S * 3 * D * F + 4 * B * S**2 * D)
    fwd += 2 * B * S * D * V
    acct = symacct.derive(
        Llama(LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, hidden_dim=24, max_seq_len=16))
    )
    assert sympy.expand(acct.flops.forward - fwd) == 0
    assert sympy.expand(acct.flops.total - 3 * fwd) == 0


def test_causal_discount_halves_only_attention_scores():
    model = GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16, tie_weights=False))
    full = symacct.derive(model).flops.total
    half = symacct.derive(model, causal_discount=True).flops.total
    # Megatron's convention: the 12 B S^2 D L attention term is halved, nothing else changes
    assert sympy.expand(full - half - 6 * B * S**2 * D * L) == 0


def test_module_without_config_has_only_batch_symbols():
    # Linear(8, 4), ReLU, Linear(4, 3): forward 2*B*8*4 + 2*B*4*3; backward: both weight grads,
    # and the input grad of the second layer only (the model's input needs none)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    acct = symacct.derive(m, inputs=lambda B, S: (torch.randn(B, 8),), loss=lambda out: out.sum())
    assert sympy.expand(acct.flops.forward - (2 * B * 8 * 4 + 2 * B * 4 * 3)) == 0
    assert sympy.expand(acct.flops.backward - (2 * B * 8 * 4 + 2 * 2 * B * 4 * 3)) == 0
    assert acct.params == 8 * 4 + 4 + 4 * 3 + 3
