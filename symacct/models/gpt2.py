"""GPT-2 in one file (nanoGPT style): learned positions, pre-LayerNorm, GELU MLP.

Letters in the shape comments: B batch, S sequence, D = n_embd, H = n_head,
Dh = D / H, V = vocab_size, S_max = block_size, C cached positions.

Serving: ``forward(idx, cache=[])`` is a prefill (it appends each layer's keys and values, S positions, to
the list), ``forward(idx, cache=kv)`` with a full list a decode step (S new positions after C cached
ones: each layer's entry replaced by the concatenation, as transformers' DynamicCache does); with a
cache, the logits are those of the last position only (what generation samples from).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

Cache = list[tuple[torch.Tensor, torch.Tensor]]  # a layer's keys and values, (B, H, C, Dh) each


@dataclass
class GPT2Config:
    block_size: int = 1024  # S_max: longest sequence the position table holds
    vocab_size: int = 50257  # V: tokens in the vocabulary
    n_layer: int = 12  # L: transformer blocks
    n_head: int = 12  # H: attention heads
    n_embd: int = 768  # D: model width
    dropout: float = 0.1  # on embeddings, attention probabilities and residuals
    bias: bool = True  # biases in Linear and LayerNorm
    tie_weights: bool = True  # LM head shares the token-embedding matrix
    sdpa: bool = False  # attention through F.scaled_dot_product_attention
    checkpoint: bool = False  # recompute each block in backward (torch.utils.checkpoint, non-reentrant)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.sdpa = config.sdpa
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        if not config.sdpa:
            mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
            self.register_buffer("mask", mask, persistent=False)  # (S_max, S_max)

    def forward(
        self, x: torch.Tensor, kv: Cache | None = None, i: int = 0, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        B, S, D = x.shape
        Dh = D // self.n_head  # heads counted from c_attn's width: a tensor-parallel rank holds H/tp of them
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, S, D)
        q = q.view(B, S, -1, Dh).transpose(1, 2)  # (B, H, S, Dh)
        k = k.view(B, S, -1, Dh).transpose(1, 2)  # (B, H, S, Dh)
        v = v.view(B, S, -1, Dh).transpose(1, 2)  # (B, H, S, Dh)
        if kv is not None:
            return self._cached(q, k, v, kv, i, dtype)
        if self.sdpa:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))  # (B, H, S, S)
            att = att.masked_fill(~self.mask[:S, :S], float("-inf"))  # (B, H, S, S)
            att = F.softmax(att, dim=-1)  # (B, H, S, S)
            att = self.attn_dropout(att)
            y = att @ v  # (B, H, S, Dh)
        y = y.transpose(1, 2).contiguous().view(B, S, -1)  # (B, S, D)
        return self.resid_dropout(self.c_proj(y))  # (B, S, D)

    def _cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: Cache, i: int, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Attention of S new positions over the C cached ones and themselves; layer i's cache entry updated.
        The cache holds ``dtype`` (prefill; decode keeps the cache's own): an fp8 cache is cast up to the
        compute dtype for attention."""
        B, _, S, Dh = q.shape
        if i == len(kv):  # prefill: the layer's keys and values in storages of their own (views would keep
            # the fused q, k, v output alive), (B, H, S, Dh) each
            kv.append((k.contiguous(), v.contiguous()) if dtype in (None, k.dtype) else (k.to(dtype), v.to(dtype)))
            C = 0
        else:  # decode: (B, H, C, Dh) cached, (B, H, C + S, Dh) after
            C, held = kv[i][0].size(2), kv[i][0].dtype
            kv[i] = (torch.cat((kv[i][0], k.to(held)), dim=2), torch.cat((kv[i][1], v.to(held)), dim=2))
        k, v = kv[i][0].to(q.dtype), kv[i][1].to(q.dtype)  # (B, H, C + S, Dh); a copy only for another dtype
        if self.sdpa:
            mask = torch.ones(S, C + S, dtype=torch.bool, device=q.device).tril(diagonal=C)  # (S, C + S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, S, Dh)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))  # (B, H, S, C + S)
            att = att.masked_fill(~self.mask[C : C + S, : C + S], float("-inf"))  # (B, H, S, C + S)
            y = F.softmax(att, dim=-1) @ v  # (B, H, S, Dh)
        y = y.transpose(1, 2).contiguous().view(B, S, -1)  # (B, S, D)
        return self.c_proj(y)  # (B, S, D)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gelu(self.c_fc(x))  # (B, S, 4D)
        return self.dropout(self.c_proj(h))  # (B, S, D)


class Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, kv: Cache | None = None, i: int = 0, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, i, dtype)  # (B, S, D)
        return x + self.mlp(self.ln_2(x))  # (B, S, D)


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # (V, D)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # (S_max, D)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: Cache | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            return self._serve(idx, cache, cache_dtype)
        B, S = idx.shape
        pos = torch.arange(S, device=idx.device)  # (S,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, S, D)
        for block in self.blocks:
            if self.config.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # (B, S, D)
            else:
                x = block(x)  # (B, S, D)
        logits = self.lm_head(self.ln_f(x))  # (B, S, V)
        if targets is None:
            return logits
        V = logits.size(-1)
        return F.cross_entropy(logits.view(B * S, V), targets.view(B * S))  # scalar

    def _serve(self, idx: torch.Tensor, cache: Cache, dtype: torch.dtype | None) -> torch.Tensor:
        """Prefill (an empty cache) or decode (a full one): the logits of the last position, (B, 1, V)."""
        B, S = idx.shape
        C = cache[0][0].size(2) if cache else 0
        pos = torch.arange(C, C + S, device=idx.device)  # (S,)
        x = self.wte(idx) + self.wpe(pos)  # (B, S, D)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i, dtype)  # (B, S, D)
        return self.lm_head(self.ln_f(x[:, -1:]))  # (B, 1, V)

    def prefill_inputs(self, B: int, S: int, cache_dtype: torch.dtype | None = None) -> dict[str, object]:
        """A prompt of S tokens and an empty cache (to hold ``cache_dtype``; default: the compute dtype)."""
        ids = torch.randint(0, self.config.vocab_size, (B, S))
        return {"idx": ids, "cache": [], "cache_dtype": cache_dtype}

    def decode_inputs(self, B: int, S: int, C: int, cache_dtype: torch.dtype | None = None) -> dict[str, object]:
        """S new tokens (derive's decode step: 1) and a cache of C positions: (B, H, C, Dh) keys and values a
        layer."""
        H, D = self.config.n_head, self.config.n_embd
        dt = cache_dtype or self.wte.weight.dtype
        kv = [(torch.randn(B, H, C, D // H).to(dt), torch.randn(B, H, C, D // H).to(dt)) for _ in self.blocks]
        return {"idx": torch.randint(0, self.config.vocab_size, (B, S)), "cache": kv}

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets, both (B, S) int64."""
        V = self.config.vocab_size
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))

    def tp_plan(self, sequence_parallel: bool = False) -> Callable[[nn.Module, Any], None]:
        """The standard tensor-parallel plan (Megatron's for GPT-2), as a function ``plan(model, mesh)``: the
        token embedding split by vocabulary rows (the position table replicated), each block's fused q/k/v
        projection and MLP up projection by output columns, both output projections by input rows, the
        tied head by vocabulary columns with the logits gathered (no loss parallelism). c_attn's rows are
        first reordered so that each rank's columns are whole heads of q, k and v ([q_r; k_r; v_r] for rank
        r, as Megatron lays out its fused projection): the sharded model computes what this one does. With
        ``sequence_parallel`` the norms, dropouts and residual stream are split along the sequence (dim 1)
        from the first block on, gathered before attention and the MLP, reduce-scattered after them."""
        return functools.partial(_parallelize, sequence_parallel=sequence_parallel)

    def pipeline_stage(self, stage: int, pp: int) -> GPT2Stage:
        """Stage ``stage`` of ``pp`` for ``torch.distributed.pipelining`` (its modules shared with this model)."""
        return GPT2Stage(self, stage, pp)


def _heads_by_rank(t: torch.Tensor, tp: int) -> torch.Tensor:
    """c_attn's rows [q; k; v] (3D, ...) reordered as [q_0; k_0; v_0; q_1; ...]: rank r's D/tp rows of each."""
    rest = t.shape[1:]
    return t.reshape(3, tp, t.shape[0] // (3 * tp), *rest).transpose(0, 1).reshape(t.shape)


def _parallelize(model: GPT2, mesh: Any, sequence_parallel: bool) -> None:
    """``GPT2.tp_plan``'s plan applied to ``model`` over the 1-D tensor-parallel ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            lin = block.attn.c_attn
            lin.weight = nn.Parameter(_heads_by_rank(lin.weight, tp))
            if lin.bias is not None:
                lin.bias = nn.Parameter(_heads_by_rank(lin.bias, tp))
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        plan[p + "attn.c_attn"] = plan[p + "mlp.c_fc"] = ColwiseParallel()
        plan[p + "attn.c_proj"] = RowwiseParallel(output_layouts=stream)
        plan[p + "mlp.c_proj"] = RowwiseParallel(output_layouts=stream)
        if sequence_parallel:  # attn(x, kv, i, dtype) and mlp(x): x gathered
            plan[p + "ln_1"] = plan[p + "ln_2"] = SequenceParallel()
            plan[p + "attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            )
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if sequence_parallel:  # the embeddings' sum enters the stack whole: each rank keeps its part of S
        plan["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        plan["ln_f"] = SequenceParallel()
    tied = model.lm_head.weight is model.wte.weight
    parallelize_module(model, mesh, plan)
    if tied:  # both split the (V, D) table by rows: the head shares the embedding's shards again
        model.lm_head.weight = model.wte.weight


class GPT2Stage(nn.Module):
    """L/pp consecutive blocks of a GPT2; the first stage embeds the token ids, the last returns the logits
    (the loss is the schedule's ``loss_fn``). A tied head is the embedding's own weight: across processes
    each end stage then holds a copy, whose gradients the pipeline does not sum."""

    def __init__(self, model: GPT2, stage: int, pp: int) -> None:
        super().__init__()
        n = len(model.blocks) // pp
        self.first, self.last = stage == 0, stage == pp - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[stage * n : (stage + 1) * n])
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.checkpoint = model.config.checkpoint  # as the whole model: each block recomputed in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: (B, S) token ids
            pos = torch.arange(x.size(1), device=x.device)  # (S,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, S, D)
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # (B, S, D)
            else:
                x = block(x)  # (B, S, D)
        return self.lm_head(self.ln_f(x)) if self.last else x  # (B, S, V) or (B, S, D)
