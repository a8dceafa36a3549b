"""Memory formulas that explain themselves: checkpoint files, activation checkpointing, Korthikanti.

The activation comparison (gpt2 with dropout and bf16 autocast, per layer,
against Korthikanti et al. 2022, section 4: s*b*h*(34 + 5*a*s/h) bytes)
derives both sides' terms; the difference is explained term by term here
and in docs/memory.md.
"""

from __future__ import annotations

import io

import sympy
import torch

import symacct
from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
from symacct.symbols import B, D, H, S


def small_gpt2(**kw) -> GPT2:
    return GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16, **kw))


def test_checkpoint_file_size_is_tensor_bytes_plus_bounded_overhead():
    """torch.save stores each storage once; the zip/pickle overhead is bounded per entry (stated tolerance)."""
    acct = symacct.derive(small_gpt2(), optimizer="adamw")
    cfg = GPT2Config(n_layer=3, n_embd=24, n_head=3, vocab_size=50, block_size=12)
    model = GPT2(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(*model.example_inputs(2, 5)).backward()
    opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    predicted = acct.at(B=2, S=5, L=3, D=24, H=3, V=50, S_max=12).memory.checkpoint
    entries = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    overhead = len(buf.getvalue()) - predicted
    assert 0 <= overhead <= 2048 + 512 * entries
    # the tensor bytes themselves, exactly: every distinct storage in the two state dicts
    tensors = [*model.state_dict().values()] + [
        v for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    assert predicted == sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def test_activation_checkpointing_saving_and_cost():
    """The seed: checkpointing 'cuts activation memory by more than half at the cost of one extra forward'."""
    plain = symacct.derive(small_gpt2(dropout=0.0))
    ckpt = symacct.derive(small_gpt2(dropout=0.0, checkpoint=True))
    per_layer = plain.memory.activations_per_layer["blocks"]
    per_layer_ckpt = ckpt.memory.activations_per_layer["blocks"]
    # with checkpointing only the block input is saved: 4*B*S*D bytes (fp32) per layer
    assert sympy.expand(per_layer_ckpt - 4 * B * S * D) == 0
    # the cut is far more than half, for every size: per_layer - 2*per_layer_ckpt has no negative coefficient
    diff = sympy.expand(per_layer - 2 * per_layer_ckpt)
    assert all(c > 0 for c in sympy.Poly(diff, *sorted(diff.free_symbols, key=str)).coeffs())
    # the cost: less than one more forward of the blocks. Non-reentrant checkpointing stops the
    # recomputation once every saved tensor is back, so each block's last matmul (mlp.c_proj,
    # whose output nothing saves) is not run again
    blocks_forward = sympy.expand(plain.flops.forward - plain.components["head"]["flops_forward"])
    last = plain.modules["blocks.*.mlp.c_proj"]["flops_forward"]
    assert sympy.expand(ckpt.flops.recompute - (blocks_forward - last)) == 0
    assert sympy.expand(ckpt.flops.total - plain.flops.total) == 0  # model FLOPs do not change
    # with dropout the residual dropout's mask must be regenerated: then it is one full forward
    with_dropout = symacct.derive(small_gpt2(dropout=0.1, checkpoint=True))
    assert sympy.expand(with_dropout.flops.recompute - blocks_forward) == 0


def test_llama_checkpointing_recomputes_one_forward():
    cfg = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, hidden_dim=24, max_seq_len=16)
    plain = symacct.derive(Llama(LlamaConfig(**cfg)))
    ckpt = symacct.derive(Llama(LlamaConfig(**cfg, checkpoint=True)))
    L = sympy.Symbol("L", integer=True, positive=True)
    # one forward of every layer but its last matmul (feed_forward.w2: early-stopped recomputation)
    last = plain.modules["layers.*.feed_forward.w2"]["flops_forward"]
    assert sympy.expand(ckpt.flops.recompute - (L * plain.per_layer["layers"]["flops_forward"] - last)) == 0


def test_gpt2_activations_against_korthikanti():
    """Per layer, bf16 autocast with dropout, math attention: derive vs s*b*h*(34 + 5*a*s/h).

    Korthikanti et al. 2022 (16-bit activations, 1-byte dropout masks, a = heads) per layer:
      LayerNorm inputs 4sbh; attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2,
      output-projection input 2, dropout mask 1; softmax output 2, its dropout mask 1,
      dropout output 2 per s^2 a b); MLP 19sbh (fc1 input 2, GeLU input 8, fc2 input 8, mask 1).
    What derive finds for this gpt2 under CPU bf16 autocast, per layer:
      * B*S*D: 40, not 34. The two LayerNorm inputs (the residual stream) stay fp32 under
        autocast: 4 + 4 instead of 2 + 2 (+4); the two residual dropout masks are kept by
        PyTorch as bf16 tensors, 2 bytes each instead of 1 (+2). Every other term agrees:
        QKV input 2, Q and K 2 + 2, V 2, projection input 2, fc1 input 2, GELU input 8,
        fc2 input 8;
      * B*H*S^2: 6, not 5: the attention dropout mask is a 2-byte bf16 tensor (+1);
      * S^2: 1 byte, the causal mask (bool, S x S) that masked_fill saves: not in the paper;
      * D^2: 24, autocast's bf16 copies of the 12 D^2 block weights, saved by the matmuls:
        the paper counts weights elsewhere;
      * B*S: 16, LayerNorm's fp32 mean and rstd (two norms, 2 x 4 bytes per row): the paper
        drops them (it says so).
    """
    acct = symacct.derive(small_gpt2(dropout=0.1), autocast=torch.bfloat16)
    ours = acct.memory.activations_per_layer["blocks"]
    korthikanti = S * B * D * (34 + 5 * H * S / D)
    poly = sympy.Poly(ours, B, S, D, H)
    assert poly.coeff_monomial(B * S * D) == 34 + 4 + 2
    assert poly.coeff_monomial(B * H * S**2) == 5 + 1
    assert poly.coeff_monomial(S**2) == 1
    assert poly.coeff_monomial(D**2) == 2 * 12
    assert poly.coeff_monomial(B * S) == 2 * 2 * 4
    explained = korthikanti + (4 + 2) * B * S * D + B * H * S**2 + S**2 + 24 * D**2 + 16 * B * S
    assert sympy.expand(ours - explained) == 0  # nothing left unexplained
