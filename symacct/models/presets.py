"""Named configurations of the reference models, for the CLI and the docs."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from symacct.models.cruncher import Cruncher, CruncherConfig
from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.models.llama import Llama, LlamaConfig

# name -> (model class, config factory)
PRESETS: dict[str, tuple[type[nn.Module], Callable[[], object]]] = {
    "cruncher": (Cruncher, CruncherConfig),
    "gpt2": (GPT2, GPT2Config),  # GPT-2 small, 124M
    "gpt2-medium": (GPT2, lambda: GPT2Config(n_layer=24, n_head=16, n_embd=1024)),
    "gpt2-xl": (GPT2, lambda: GPT2Config(n_layer=48, n_head=25, n_embd=1600)),
    "llama": (Llama, LlamaConfig),  # Llama 2 7B
    "llama3-8b": (
        Llama,
        lambda: LlamaConfig(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336, max_seq_len=8192
        ),
    ),
    "llama3-70b": (
        Llama,
        lambda: LlamaConfig(
            dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, hidden_dim=28672, max_seq_len=8192
        ),
    ),
    "llama3-405b": (
        Llama,
        lambda: LlamaConfig(
            dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, hidden_dim=53248, max_seq_len=8192
        ),
    ),
}
