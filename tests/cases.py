"""Model cases shared by the exactness tests: hypothesis strategies that draw a
real config with its (B, S), the symbol values of a config, and the derived
accounting of each code-path variant (derived once: sizes do not change it)."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from hypothesis import strategies as st

import symacct
from symacct.models import GPT2, Cruncher, CruncherConfig, GPT2Config, Llama, LlamaConfig

Case = tuple[Any, int, int]  # (config, B, S)


@st.composite
def gpt2_cases(draw: st.DrawFn, lo: int = 1) -> Case:
    """GPT-2 configs with every switch; sizes from ``lo`` (2 where bytes are compared)."""
    B, S, H, dh = (
        draw(st.integers(lo, 3)),
        draw(st.integers(max(lo, 1), 12)),
        draw(st.integers(lo, 4)),
        draw(st.integers(lo, 6)),
    )
    cfg = GPT2Config(
        n_layer=draw(st.integers(1, 3)),
        n_head=H,
        n_embd=H * dh,
        vocab_size=draw(st.integers(2, 40)),
        block_size=S + draw(st.integers(0, 5)),
        tie_weights=draw(st.booleans()),
        sdpa=draw(st.booleans()),
        bias=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.1])),
        checkpoint=draw(st.booleans()),
    )
    return cfg, B, S


@st.composite
def llama_cases(draw: st.DrawFn, lo: int = 1) -> Case:
    """Llama configs: H = H_kv * rep, even head width (rotary), math or SDPA attention."""
    B, S, Hkv, rep = (
        draw(st.integers(lo, 3)),
        draw(st.integers(max(lo, 1), 12)),
        draw(st.integers(lo, 3)),
        draw(st.integers(lo, 3)),
    )
    H, dh = Hkv * rep, 2 * draw(st.integers(1, 4))
    cfg = LlamaConfig(
        dim=H * dh,
        n_layers=draw(st.integers(1, 3)),
        n_heads=H,
        n_kv_heads=Hkv,
        vocab_size=draw(st.integers(2, 40)),
        hidden_dim=draw(st.integers(lo, 30)),
        max_seq_len=S + draw(st.integers(0, 3)),
        sdpa=draw(st.booleans()),
        checkpoint=draw(st.booleans()),
    )
    return cfg, B, S


@st.composite
def cruncher_cases(draw: st.DrawFn, lo: int = 1) -> Case:
    return CruncherConfig(dim=draw(st.integers(lo, 40)), n_layers=draw(st.integers(1, 5))), draw(st.integers(lo, 9)), 1


_MODELS = {GPT2Config: GPT2, LlamaConfig: Llama, CruncherConfig: Cruncher}
_SMALL = {
    GPT2Config: GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=8),
    LlamaConfig: LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16, hidden_dim=12, max_seq_len=8),
    CruncherConfig: CruncherConfig(dim=8, n_layers=2),
}


def build(cfg: Any) -> Any:
    return _MODELS[type(cfg)](cfg)


def switches(cfg: Any) -> tuple[tuple[str, Any], ...]:
    """The non-size fields of a config: they choose the code path."""
    return tuple(
        (f.name, getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if not isinstance(getattr(cfg, f.name), int) or isinstance(getattr(cfg, f.name), bool)
    )


@cache
def _derived(kind: type, sw: tuple[tuple[str, Any], ...]) -> symacct.Accounting:
    return symacct.derive(build(dataclasses.replace(_SMALL[kind], **dict(sw))))


def derived(cfg: Any) -> symacct.Accounting:
    """The accounting of ``cfg``'s variant, derived from a small model of the same switches."""
    return _derived(type(cfg), switches(cfg))


def sizes(cfg: Any) -> dict[str, int]:
    """Symbol values of a config."""
    if isinstance(cfg, GPT2Config):
        return dict(L=cfg.n_layer, H=cfg.n_head, D=cfg.n_embd, V=cfg.vocab_size, S_max=cfg.block_size)
    if isinstance(cfg, LlamaConfig):
        return dict(
            L=cfg.n_layers,
            H=cfg.n_heads,
            H_kv=cfg.n_kv_heads,
            D=cfg.dim,
            V=cfg.vocab_size,
            F=cfg.hidden_dim,
            S_max=cfg.max_seq_len,
        )
    return dict(L=cfg.n_layers, D=cfg.dim)


OPTIMIZERS = [
    ("sgd", ()),
    ("sgd", (("momentum", 0.9),)),
    ("adagrad", ()),
    ("adam", ()),
    ("adamw", ()),
    ("adamw", (("foreach", True),)),
    ("adam", (("foreach", True),)),
    ("sgd", (("momentum", 0.9), ("foreach", True))),
    ("adamw", (("fused", True),)),
]


@cache
def _derived_opt(
    kind: type, sw: tuple[tuple[str, Any], ...], opt: str, opts: tuple[tuple[str, Any], ...]
) -> symacct.Accounting:
    model = build(dataclasses.replace(_SMALL[kind], **dict(sw)))
    return symacct.derive(model, optimizer=opt, optimizer_options=dict(opts))


def derived_with_optimizer(cfg: Any, opt: str, opts: tuple[tuple[str, Any], ...]) -> symacct.Accounting:
    return _derived_opt(type(cfg), switches(cfg), opt, opts)
