"""Llama in one file: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Letters in the shape comments: B batch, S sequence, D = dim, H = n_heads,
H_kv = n_kv_heads, Dh = D / H, F = hidden_dim, V = vocab_size,
S_max = max_seq_len. No biases, no dropout, untied output head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.wq(x).view(B, S, H, Dh).transpose(1, 2)  # (B, H, S, Dh)
        k = self.wk(x).view(B, S, Hkv, Dh).transpose(1, 2)  # (B, H_kv, S, Dh)
        v = self.wv(x).view(B, S, Hkv, Dh).transpose(1, 2)  # (B, H_kv, S, Dh)
        q = q * cos + rotate_half(q) * sin  # (B, H, S, Dh)
        k = k * cos + rotate_half(k) * sin  # (B, H_kv, S, Dh)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, S, D)
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

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
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

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets, both (B, S) int64."""
        V = self.config.vocab_size
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
