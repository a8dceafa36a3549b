"""The only place where symacct makes sympy symbols.

Letters: B batch, S sequence (S_dec a decoder's, sequence-to-sequence), D model width, F ffn width, L layers, H heads,
H_kv key/value heads, V vocabulary, S_max longest sequence (block size), E
experts and k experts per token (mixture of experts). Any
other integer config field that reaches a shape gets a symbol named after
the field. All symbols are ``integer=True, positive=True`` so that they
cancel and compare.
"""

from __future__ import annotations

import re
from functools import cache

import sympy

# config field name -> letter
ALIASES: dict[str, str] = {
    "n_embd": "D",
    "d_model": "D",
    "hidden_size": "D",
    "dim": "D",
    "n_head": "H",
    "n_heads": "H",
    "num_attention_heads": "H",
    "num_heads": "H",
    "n_kv_heads": "H_kv",
    "num_key_value_heads": "H_kv",
    "n_layer": "L",
    "n_layers": "L",
    "num_hidden_layers": "L",
    "vocab_size": "V",
    "intermediate_size": "F",
    "ffn_dim": "F",
    "hidden_dim": "F",
    "d_ff": "F",
    "block_size": "S_max",
    "max_seq_len": "S_max",
    "max_position_embeddings": "S_max",
    "n_positions": "S_max",
    "n_ctx": "S_max",
    "num_local_experts": "E",
    "num_experts": "E",
    "n_routed_experts": "E",
    "num_experts_per_tok": "k",
    "moe_top_k": "k",
}

# fixed order used whenever symbols are printed or sorted
ORDER: tuple[str, ...] = ("B", "S", "S_dec", "L", "D", "H", "H_kv", "F", "V", "S_max", "E", "k")

MEANING: dict[str, str] = {
    "B": "batch size",
    "S": "sequence length",
    "S_dec": "decoder sequence length (sequence-to-sequence)",
    "L": "layers (blocks)",
    "D": "model width",
    "H": "attention heads",
    "H_kv": "key/value heads",
    "F": "feed-forward width",
    "V": "vocabulary size",
    "S_max": "longest sequence (position table rows)",
    "E": "experts (mixture of experts)",
    "k": "experts per token (top-k routing)",
}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@cache
def sym(name: str) -> sympy.Symbol:
    """The symbol called ``name`` (positive integer)."""
    if not _NAME.match(name):
        raise ValueError(f"not a valid symbol name: {name!r}")
    return sympy.Symbol(name, integer=True, positive=True)


def evaluate(expr: sympy.Expr | int, values: dict[str, int]) -> int:
    """An integer-valued formula at integer sizes, exactly (``values`` maps symbol names to sizes)."""
    return int(sympy.sympify(expr).xreplace({sym(k): v for k, v in values.items()}))


def letter_for_field(field: str) -> str:
    """The letter of a config field: its alias, or the field name itself."""
    return ALIASES.get(field, field)


def sort_key(name: str) -> tuple[int, str]:
    """Order symbols as in ``ORDER``, others alphabetically after them."""
    return (ORDER.index(name), "") if name in ORDER else (len(ORDER), name)


B = sym("B")
S = sym("S")
L = sym("L")
D = sym("D")
H = sym("H")
H_kv = sym("H_kv")
F = sym("F")
V = sym("V")
S_max = sym("S_max")
