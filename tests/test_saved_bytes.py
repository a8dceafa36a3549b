"""Saved-activation bytes equal what saved_tensors_hooks sees on a real CPU step, exactly.

Sizes are drawn >= 2: at a size of 1 PyTorch's kernels may take a view where
they otherwise copy (a (1, H, S, Dh) tensor is viewable as (H, S, Dh)), so
byte formulas hold for sizes >= 2 (as torch.compile's dynamic shapes
specialise 0 and 1). ``test_size_one_is_flagged`` shows the case and that
``at()`` says so.
"""

from __future__ import annotations

import torch
from cases import build, cruncher_cases, derived, gpt2_cases, llama_cases, sizes
from hypothesis import given

import symacct
from symacct.measure.run import measure_step
from symacct.models import GPT2, GPT2Config


def check(case) -> None:
    cfg, B, S = case
    model = build(cfg)
    torch.manual_seed(0)
    got = derived(cfg).at(B=B, S=S, **sizes(cfg))
    assert got.saved_bytes == measure_step(model, model.example_inputs(B, S)).saved_bytes


@given(gpt2_cases(lo=2))
def test_gpt2_saved_bytes(case):
    check(case)


@given(llama_cases(lo=2))
def test_llama_saved_bytes(case):
    check(case)


@given(cruncher_cases(lo=2))
def test_cruncher_saved_bytes(case):
    check(case)


def test_size_one_is_flagged():
    acct = derived(GPT2Config(sdpa=True, dropout=0.1))
    sizes = dict(S=3, L=1, H=2, D=4, V=5, S_max=4)
    model = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=4, vocab_size=5, block_size=4, sdpa=True, dropout=0.1))
    at_one = acct.at(B=1, **sizes)
    measured = measure_step(model, model.example_inputs(1, 3)).saved_bytes
    assert at_one.saved_bytes != measured  # PyTorch skips the q/k/v copies when B*H == 1 ...
    assert any("size 1" in n or "sizes >= 2" in n for n in at_one.notes)  # ... and at() says so
    assert not any("sizes >= 2" in n for n in acct.at(B=2, **sizes).notes)


def test_heads_of_width_one_follow_h():
    """A model whose heads are 1 wide (D = H > 1) transposes them for free (a size-1 dimension's stride is
    not read), so it copies less than the probe model, whose heads are wider: derive's second try lets D
    follow H, and the formulas equal a real CPU step (saved_tensors_hooks, FlopCounterMode) at other B, S."""
    from torch.utils.flop_counter import FlopCounterMode

    for dropout in (0.0, 0.1):
        cfg = GPT2Config(n_layer=3, n_head=4, n_embd=4, vocab_size=16, block_size=8, dropout=dropout)
        with torch.device("meta"):
            acct = symacct.derive(GPT2(cfg))
        assert "n_embd = n_head (heads of width 1): it follows H" in acct.notes
        assert set(acct.symbols) == {"L", "H", "V", "S_max"}  # no D: it is H
        model = GPT2(cfg)
        for B, S in ((2, 8), (3, 5)):
            torch.manual_seed(0)
            assert acct.at(B=B, S=S).saved_bytes == measure_step(model, model.example_inputs(B, S)).saved_bytes
            with FlopCounterMode(display=False) as fc:
                model(*model.example_inputs(B, S)).backward()
            assert acct.at(B=B, S=S).flops.total == fc.get_total_flops()
