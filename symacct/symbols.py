"""The only place where symacct makes sympy symbols.

Letters: B batch, S sequence (S_dec a decoder's, sequence-to-sequence), D model width, F ffn width, L layers, H heads,
H_kv key/value heads, V vocabulary, S_max longest sequence (block size), E
experts and k experts per token (mixture of experts). Any
other integer config field that reaches a shape gets a symbol named after
the field. All symbols are ``integer=True, positive=True`` so that they
cancel and compare.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from functools import cache
from typing import Any

import sympy

# config field name -> letter; where two fields of one config read as one letter with different values (MiniMax's
# linear-attention block_size and its max_position_embeddings), the one listed first keeps it (symacct.pipeline)
ALIASES: dict[str, str] = {
    "n_embd": "D",
    "d_model": "D",
    "hidden_size": "D",
    "dim": "D",
    "n_head": "H",
    "n_heads": "H",
    "num_attention_heads": "H",
    "num_heads": "H",
    "encoder_attention_heads": "H",  # BART and its kin: one symbol where encoder and decoder agree
    "decoder_attention_heads": "H",
    "num_key_value_heads": "H_kv",
    "n_kv_heads": "H_kv",
    "num_kv_heads": "H_kv",  # Falcon
    "n_layer": "L",
    "n_layers": "L",
    "num_hidden_layers": "L",
    "vocab_size": "V",
    "decoder_vocab_size": "V",  # Marian: the decoder's own vocabulary, its embeddings and LM head
    "intermediate_size": "F",
    "ffn_dim": "F",
    "hidden_dim": "F",
    "d_ff": "F",
    "ffn_hidden_size": "F",  # Falcon, Megatron
    "encoder_ffn_dim": "F",  # BART and its kin
    "decoder_ffn_dim": "F",
    "max_position_embeddings": "S_max",
    "n_positions": "S_max",
    "max_seq_len": "S_max",
    "max_seq_length": "S_max",
    "max_len": "S_max",
    "n_ctx": "S_max",
    "max_target_positions": "S_max",  # an encoder-decoder's decoder positions (Whisper, Speech2Text)
    "block_size": "S_max",  # nanoGPT's context; elsewhere a chunk's or a sparse-attention block's length
    "num_local_experts": "E",
    "num_experts": "E",
    "n_routed_experts": "E",
    "moe_num_experts": "E",  # Aria, ERNIE 4.5, Hunyuan MoE
    "num_experts_per_tok": "k",
    "moe_top_k": "k",
    "moe_topk": "k",
    "top_k_experts": "k",  # Gemma 4
}

# fixed order used whenever symbols are printed or sorted
ORDER: tuple[str, ...] = ("B", "S", "S_dec", "L", "D", "H", "H_kv", "F", "V", "S_max", "E", "k")

MEANING: dict[str, str] = {
    "B": "batch size",
    "S": "sequence length",
    "S_dec": "decoder sequence length (sequence-to-sequence)",
    "C": "positions in the KV cache before a decode step",
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


class Terms:
    """A sum of formulas collected term by term and added once (``sum``).

    ``total += term`` on a sympy ``Add`` re-flattens the whole sum every time
    (quadratic in the number of terms); ``terms += term`` only appends. A
    ``defaultdict(Terms)`` reads like a dict of running sums.
    """

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __iadd__(self, term: Any) -> Terms:
        self.items.append(term)
        return self

    def sum(self) -> sympy.Expr:
        return sympy.Add(*self.items) if self.items else sympy.Integer(0)


def _sympy_value(expr: sympy.Expr, values: Mapping[str, int]) -> Fraction:
    v = sympy.sympify(expr).xreplace({sym(k): sympy.Integer(n) for k, n in values.items()})
    if not v.is_Rational:
        raise ValueError(f"{expr} is not a rational number at {dict(values)}: {v}")
    return Fraction(int(v.p), int(v.q))


_FUNCS: dict[Any, str] = {sympy.ceiling: "_ceil", sympy.floor: "_floor", sympy.Max: "max", sympy.Min: "min"}


class _Unsupported(Exception):
    pass


def _code(e: Any, names: dict[str, int]) -> str:
    """Python source computing ``e`` exactly over ``_v`` (the symbols' values in ``names`` order): integers,
    ``Fraction`` where a coefficient or a power is not whole."""
    if e.is_Integer:
        return str(int(e))
    if e.is_Rational:
        return f"_q({int(e.p)}, {int(e.q)})"
    if e.is_Symbol:
        return f"_v[{names.setdefault(e.name, len(names))}]"
    if e.is_Add:
        return "(" + " + ".join(_code(a, names) for a in e.args) + ")"
    if e.is_Mul:
        num, den = [], []
        for a in e.args:
            if a.is_Rational and not a.is_Integer:
                num.append(str(int(a.p)))
                den.append(str(int(a.q)))
            elif a.is_Pow and a.exp.is_Integer and a.exp < 0:
                den.append(f"({_code(a.base, names)})" + ("" if a.exp == -1 else f" ** {int(-a.exp)}"))
            else:
                num.append(_code(a, names))
        top = " * ".join(num) or "1"
        return f"_q({top}, {' * '.join(den)})" if den else f"({top})"
    if e.is_Pow and e.exp.is_Integer:
        base = _code(e.base, names)
        return f"({base}) ** {int(e.exp)}" if e.exp > 0 else f"_q(1, ({base}) ** {int(-e.exp)})"
    if e.is_Function and e.func in _FUNCS:
        return f"{_FUNCS[e.func]}(" + ", ".join(_code(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Mod):
        return f"(({_code(e.args[0], names)}) % ({_code(e.args[1], names)}))"
    raise _Unsupported(type(e).__name__)


def _q(a: int | Fraction, b: int | Fraction) -> int | Fraction:
    """a / b exactly: an integer where it divides."""
    if type(a) is int and type(b) is int:
        return a // b if a % b == 0 else Fraction(a, b)
    return Fraction(a) / b


@functools.lru_cache(maxsize=16384)
def exact_form(expr: sympy.Expr) -> Callable[[Mapping[str, int]], int | Fraction]:
    """``expr`` compiled to Python once: its exact value at integer sizes (symbol name -> int), in integers and
    ``Fraction`` (``ceiling``, ``floor``, ``Max``, ``Min`` and ``Mod`` included, none of them through sympy); an
    expression of another kind (a float, a root) goes to sympy."""
    names: dict[str, int] = {}
    try:
        body = _code(sympy.sympify(expr), names)
    except _Unsupported:
        return functools.partial(_sympy_value, expr)
    order = tuple(names)
    fn = eval(f"lambda _v: {body}", {"_q": _q, "_ceil": math.ceil, "_floor": math.floor})  # noqa: S307

    def value(values: Mapping[str, int]) -> int | Fraction:
        got = fn([values[n] for n in order])
        return int(got) if isinstance(got, Fraction) and got.denominator == 1 else got

    return value


def integer_form(expr: sympy.Expr) -> Callable[[Mapping[str, int]], int]:
    """``exact_form`` truncated as ``evaluate`` truncates (``int`` of sympy's rational)."""
    f = exact_form(expr)
    return lambda values: int(f(values))


@functools.lru_cache(maxsize=1024)
def integer_forms(exprs: tuple[sympy.Expr, ...]) -> Callable[[Mapping[str, int]], list[int]]:
    """``integer_form`` of each of ``exprs`` in one compiled function (the symbols' values read once, one
    call for all): what a liveness evaluates at every size it is asked for; kept per tuple of formulas (the
    livenesses a layout's stages make share them)."""
    names: dict[str, int] = {}
    bodies, other = [], []
    for e in exprs:
        try:
            bodies.append(f"_int({_code(sympy.sympify(e), names)})")
        except _Unsupported:
            bodies.append(f"_int(_x[{len(other)}](_d))")
            other.append(exact_form(e))
    order = tuple(names)
    env = {"_q": _q, "_ceil": math.ceil, "_floor": math.floor, "_int": int, "_x": other}
    fn = eval(f"lambda _v, _d: [{', '.join(bodies)}]", env)  # noqa: S307
    return lambda values: fn([values[n] for n in order], values)


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
