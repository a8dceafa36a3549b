"""Llama in one file: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Letters in the shape comments: B batch, S sequence, D = dim, H = n_heads,
H_kv = n_kv_heads, Dh = D / H, F = hidden_dim, V = vocab_size,
S_max = max_seq_len, C cached positions. No biases, no dropout, untied output head.

Serving: ``forward(tokens, cache=[])`` is a prefill (each layer's rotated keys and its values, H_kv heads,
appended to the list), ``forward(tokens, cache=kv)`` with a full list a decode step (S new positions after
C cached ones, each layer's entry replaced by the concatenation, as transformers' DynamicCache does); the
cache holds H_kv heads (grouped-query attention repeats them after the cache); with a cache the logits
are those of the last position only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

Cache = list[tuple[torch.Tensor, torch.Tensor]]  # a layer's keys and values, (B, H_kv, C, Dh) each


@dataclass
class LlamaConfig:
    # defaults: Llama 2 7B
    dim: int = 4096  # D: model width
    n_layers: int = 32  # L: transformer blocks
    n_heads: int = 32  # H: query heads
    n_kv_heads: int = 32  # H_kv: key/value heads (H % H_kv == 0)
    vocab_size: int = 32000  # V
    hidden_dim: int = 11008  # F: SwiGLU width
    max_seq_len: int = 4096  # S_max: rows of the rotary tables
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sdpa: bool = False  # attention through F.scaled_dot_product_attention
    checkpoint: bool = False  # recompute each block in backward (torch.utils.checkpoint, non-reentrant)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, S, 1)
        return x * rms * self.weight  # (B, S, D)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # 2 x (B, h, S, Dh/2)
    return torch.cat((-x2, x1), dim=-1)  # (B, h, S, Dh)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.dim % config.n_heads == 0 and config.n_heads % config.n_kv_heads == 0
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.sdpa = config.sdpa
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: Cache | None = None,
        i: int = 0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        Dh = self.head_dim  # heads counted from the projections' widths: a tensor-parallel rank holds H/tp of them
        q = self.wq(x).view(B, S, -1, Dh).transpose(1, 2)  # (B, H, S, Dh)
        k = self.wk(x).view(B, S, -1, Dh).transpose(1, 2)  # (B, H_kv, S, Dh)
        v = self.wv(x).view(B, S, -1, Dh).transpose(1, 2)  # (B, H_kv, S, Dh)
        H, Hkv = q.shape[1], k.shape[1]
        q = q * cos + rotate_half(q) * sin  # (B, H, S, Dh)
        k = k * cos + rotate_half(k) * sin  # (B, H_kv, S, Dh)
        if kv is not None:
            return self._cached(q, k, v, kv, i, dtype)
        rep = H // Hkv
        k = k[:, :, None].expand(B, Hkv, rep, S, Dh).reshape(B, H, S, Dh)  # (B, H, S, Dh)
        v = v[:, :, None].expand(B, Hkv, rep, S, Dh).reshape(B, H, S, Dh)  # (B, H, S, Dh)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, Dh)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))  # (B, H, S, S)
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()  # (S, S)
            att = att.masked_fill(~causal, float("-inf"))  # (B, H, S, S)
            y = F.softmax(att, dim=-1) @ v  # (B, H, S, Dh)
        y = y.transpose(1, 2).reshape(B, S, H * Dh)  # (B, S, D)
        return self.wo(y)  # (B, S, D)

    def _cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: Cache, i: int, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Attention of S new positions over the C cached ones and themselves; layer i's cache entry updated.
        The cache holds ``dtype`` (prefill; decode keeps the cache's own): an fp8 cache is cast up to the
        compute dtype for attention."""
        B, H, S, Dh = q.shape
        Hkv = k.shape[1]
        if i == len(kv):  # prefill: (B, H_kv, S, Dh) each (k rotated: a tensor of its own; v a view of wv's output)
            kv.append((k, v) if dtype in (None, k.dtype) else (k.to(dtype), v.to(dtype)))
            C = 0
        else:  # decode: (B, H_kv, C, Dh) cached, (B, H_kv, C + S, Dh) after
            C, held = kv[i][0].size(2), kv[i][0].dtype
            kv[i] = (torch.cat((kv[i][0], k.to(held)), dim=2), torch.cat((kv[i][1], v.to(held)), dim=2))
        k, v = kv[i][0].to(q.dtype), kv[i][1].to(q.dtype)  # a copy only for another dtype
        T, rep = C + S, H // Hkv
        k = k[:, :, None].expand(B, Hkv, rep, T, Dh).reshape(B, H, T, Dh)  # (B, H, C + S, Dh)
        v = v[:, :, None].expand(B, Hkv, rep, T, Dh).reshape(B, H, T, Dh)  # (B, H, C + S, Dh)
        mask = torch.ones(S, T, dtype=torch.bool, device=q.device).tril(diagonal=C)  # (S, C + S)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, S, Dh)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))  # (B, H, S, C + S)
            att = att.masked_fill(~mask, float("-inf"))  # (B, H, S, C + S)
            y = F.softmax(att, dim=-1) @ v  # (B, H, S, Dh)
        y = y.transpose(1, 2).reshape(B, S, H * Dh)  # (B, S, D)
        return self.wo(y)  # (B, S, D)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, S, F) -> (B, S, D)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: Cache | None = None,
        i: int = 0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, i, dtype)  # (B, S, D)
        return x + self.feed_forward(self.ffn_norm(x))  # (B, S, D)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)  # (V, D)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)  # (D, V)
        Dh = config.dim // config.n_heads
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, Dh, 2).float() / Dh)  # (Dh/2,)
        t = torch.arange(config.max_seq_len).float()  # (S_max,)
        freqs = torch.outer(t, inv_freq)  # (S_max, Dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S_max, Dh)
        self.register_buffer("cos", emb.cos(), persistent=False)  # (S_max, Dh)
        self.register_buffer("sin", emb.sin(), persistent=False)  # (S_max, Dh)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: Cache | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            return self._serve(tokens, cache, cache_dtype)
        B, S = tokens.shape
        x = self.tok_embeddings(tokens)  # (B, S, D)
        cos, sin = self.cos[:S], self.sin[:S]  # 2 x (S, Dh)
        for layer in self.layers:
            if self.config.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)  # (B, S, D)
            else:
                x = layer(x, cos, sin)  # (B, S, D)
        logits = self.output(self.norm(x))  # (B, S, V)
        if targets is None:
            return logits
        V = logits.size(-1)
        return F.cross_entropy(logits.view(B * S, V), targets.view(B * S))  # scalar

    def _serve(self, tokens: torch.Tensor, cache: Cache, dtype: torch.dtype | None) -> torch.Tensor:
        """Prefill (an empty cache) or decode (a full one): the logits of the last position, (B, 1, V)."""
        B, S = tokens.shape
        C = cache[0][0].size(2) if cache else 0
        x = self.tok_embeddings(tokens)  # (B, S, D)
        cos, sin = self.cos[C : C + S], self.sin[C : C + S]  # 2 x (S, Dh)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, dtype)  # (B, S, D)
        return self.output(self.norm(x[:, -1:]))  # (B, 1, V)

    def prefill_inputs(self, B: int, S: int, cache_dtype: torch.dtype | None = None) -> dict[str, object]:
        """A prompt of S tokens and an empty cache (to hold ``cache_dtype``; default: the compute dtype)."""
        ids = torch.randint(0, self.config.vocab_size, (B, S))
        return {"tokens": ids, "cache": [], "cache_dtype": cache_dtype}

    def decode_inputs(self, B: int, S: int, C: int, cache_dtype: torch.dtype | None = None) -> dict[str, object]:
        """S new tokens (derive's decode step: 1) and a cache of C positions: (B, H_kv, C, Dh) keys and values a
        layer."""
        Hkv, Dh = self.config.n_kv_heads, self.config.dim // self.config.n_heads
        dt = cache_dtype or self.tok_embeddings.weight.dtype
        kv = [(torch.randn(B, Hkv, C, Dh).to(dt), torch.randn(B, Hkv, C, Dh).to(dt)) for _ in self.layers]
        return {"tokens": torch.randint(0, self.config.vocab_size, (B, S)), "cache": kv}

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets, both (B, S) int64."""
        V = self.config.vocab_size
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))

    def context_parallel_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """What context parallelism shards along the sequence besides the inputs: the rotary tables, by rows
        (so built with ``max_seq_len`` equal to the step's S, as torchtitan builds them)."""
        return [(self.cos, 0), (self.sin, 0)]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, Any]:
        """The standard tensor-parallel plan (Megatron's, as torchtitan writes it for
        ``parallelize_module``): the token embedding split by vocabulary rows, each block's q/k/v and
        gate/up projections by output columns, its output and down projections by input rows, the head by
        vocabulary columns with the logits gathered (no loss parallelism). With ``sequence_parallel``
        the norms and the residual stream are split along the sequence (dim 1), gathered before attention
        and the MLP and reduce-scattered after them."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
        plan: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
        }
        for i in range(len(self.layers)):
            p = f"layers.{i}."
            plan |= {p + f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
            plan |= {p + f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")}
            plan[p + "attention.wo"] = RowwiseParallel(output_layouts=stream)
            plan[p + "feed_forward.w2"] = RowwiseParallel(output_layouts=stream)
            if sequence_parallel:  # attention(x, cos, sin, kv, i, dtype): x gathered, the rest as given
                plan[p + "attention_norm"] = plan[p + "ffn_norm"] = SequenceParallel()
                plan[p + "attention"] = PrepareModuleInput(
                    input_layouts=(Shard(1), *[None] * 5), desired_input_layouts=(Replicate(), *[None] * 5)
                )
                plan[p + "feed_forward"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        return plan

    def pipeline_stage(self, stage: int, pp: int) -> LlamaStage:
        """Stage ``stage`` of ``pp`` for ``torch.distributed.pipelining`` (its modules shared with this model)."""
        return LlamaStage(self, stage, pp)


class LlamaStage(nn.Module):
    """L/pp consecutive layers of a Llama; the first stage embeds the token ids, the last returns the logits
    (the loss is the schedule's ``loss_fn``); every stage keeps the rotary tables (buffers, no gradient)."""

    def __init__(self, model: Llama, stage: int, pp: int) -> None:
        super().__init__()
        n = len(model.layers) // pp
        self.first, self.last = stage == 0, stage == pp - 1
        if self.first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleList(model.layers[stage * n : (stage + 1) * n])
        if self.last:
            self.norm, self.output = model.norm, model.output
        self.register_buffer("cos", model.cos, persistent=False)  # (S_max, Dh)
        self.register_buffer("sin", model.sin, persistent=False)  # (S_max, Dh)
        self.checkpoint = model.config.checkpoint  # as the whole model: each layer recomputed in backward
        # sequence parallelism (the plan's norms Replicate DTensors over the tensor-parallel mesh; the stages
        # are cut before FSDP2 shards them): the stream a stage receives is its rank's S / tp positions, the
        # rotary tables are read for all S
        weight = model.norm.weight
        placements = getattr(weight, "placements", None)
        replicated = bool(placements) and all(p.is_replicate() for p in placements)
        self.sequence_shards = weight.device_mesh.size() if replicated else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.size(1) if self.first else x.size(1) * self.sequence_shards
        if self.first:  # x: (B, S) token ids
            x = self.tok_embeddings(x)  # (B, S, D), or (B, S / tp, D) with sequence parallelism
        cos, sin = self.cos[:S], self.sin[:S]
        for layer in self.layers:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)  # (B, S, D)
            else:
                x = layer(x, cos, sin)  # (B, S, D)
        return self.output(self.norm(x)) if self.last else x  # (B, S, V) or (B, S, D)
