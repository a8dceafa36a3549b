"""derive's passes one at a time (symacct.pipeline): each takes the result of the one before.

The figures themselves are checked against PyTorch's own counts elsewhere (test_flops_exact,
test_memory, ...); here each pass is checked for what it alone decides."""

from __future__ import annotations

import pytest
import sympy
import torch

from symacct.errors import SymacctError
from symacct.models import GPT2, GPT2Config
from symacct.pipeline import (
    Known,
    _request,
    account,
    check_same_model,
    choose_probes,
    memory_pass,
    read_source,
    shortest_path,
    trace_check,
    trace_first,
)
from symacct.symbols import sym

CFG = GPT2Config(n_layer=3, n_head=2, n_embd=8, vocab_size=16, block_size=16)
OPTIONS = dict(
    inputs=None,
    loss=None,
    step="train",
    optimizer="adamw",
    optimizer_options=None,
    dims=None,
    fixed=(),
    strict=True,
    causal_discount=False,
    embedding_flops="lookup",
    autocast=None,
    params_dtype=None,
    device="cpu",
    routing=None,
    cache_dtype=None,
    _degenerate=False,
)


def _model() -> GPT2:
    with torch.device("meta"):
        return GPT2(CFG)


def test_request_refuses_bad_options_before_any_trace():
    with pytest.raises(SymacctError, match="an optimizer needs step='train'"):
        _request(**{**OPTIONS, "step": "forward"})
    with pytest.raises(SymacctError, match="not a dtype name"):
        _request(**{**OPTIONS, "autocast": "fp64"})
    with pytest.raises(SymacctError, match="unknown SDPA backend"):
        _request(**{**OPTIONS, "sdpa_backend": "fastest"})
    with pytest.raises(SymacctError, match="cache_dtype"):  # a cache dtype for a training step
        _request(**{**OPTIONS, "cache_dtype": "fp8"})
    with pytest.raises(SymacctError, match="not a dtype name"):
        _request(**{**OPTIONS, "step": "decode", "optimizer": None, "cache_dtype": "int3"})
    assert _request(**{**OPTIONS, "step": "decode", "optimizer": None, "cache_dtype": "fp8"}).cache_dtype is not None


def test_read_source_names_the_sizes_and_the_layer_count():
    src = read_source(_model(), _request(**OPTIONS))
    assert src.fields == {"n_layer": "L", "n_head": "H", "n_embd": "D", "vocab_size": "V", "block_size": "S_max"}
    assert src.values == {**src.values, "n_layer": 3, "n_embd": 8} and src.loss is None  # the output is the loss


def test_probes_give_every_symbol_its_own_prime():
    model = _model()
    req = _request(**OPTIONS)
    probes = choose_probes(model, read_source(model, req), req)
    for probe in (probes.first, probes.second):
        assert len(set(probe.own.values())) == len(probe.own)
        assert probe.values["D"] % (8 * probe.values["H"]) == 0 and probe.values["S_max"] > probe.values["S"]
    assert (probes.first.layers, probes.second.layers) == (4, 5)
    assert set(probes.first.own.values()).isdisjoint(probes.second.own.values())
    # the first probe's lengths odd primes, the second's even: a path that turns on a length's parity differs
    assert probes.first.values["S"] % 2 == 1 and probes.second.values["S"] % 2 == 0


@pytest.mark.parametrize(
    "options, length",
    [
        (dict(step="decode", optimizer=None), "C"),  # the cached positions
        (dict(tensor_parallel="megatron", tp=2), "S"),  # the degrees take two of TP_PRIMES, the lengths others
    ],
)
def test_the_second_probes_lengths_are_even_in_every_step(options, length):
    req = _request(**{**OPTIONS, **options})
    probes = choose_probes(_model(), read_source(_model(), req), req)
    assert probes.first.values[length] % 2 == 1 and probes.second.values[length] % 2 == 0
    assert set(probes.first.own.values()).isdisjoint(probes.second.own.values())


def test_each_pass_feeds_the_next():
    model = _model()
    req = _request(**OPTIONS)
    src = read_source(model, req)
    probes = choose_probes(model, src, req)
    first = trace_first(src, probes, req)
    assert first.stacks == ["blocks"]
    L = sym("L")
    # every op of the probe's middle block stands for L - 2 blocks, the first and last for one each, or all four
    # blocks collapse into one standing for L: no op counts anything else
    assert {c for c in first.counts if c.has(L)} <= {L, L - 2, L - 1}
    assert set(first.counts) - {c for c in first.counts if c.has(L)} <= {sympy.Integer(0), sympy.Integer(1)}
    user = check_same_model(model, src, probes, first, req)  # the same model: nothing raised
    assert user is not None and user.span is not None and user.span[:2] == ("S", 2)  # traced again at S = 2
    second = trace_check(src, probes, first, req)
    assert shortest_path(src, probes, first, user) == ()  # the probe's ops at S = 2, B = 2 and B = 1: no bound
    assert len(second.trace.ops) > len(first.trace.ops)  # one block more
    memory, live = memory_pass(src, probes, first, second, req)
    assert live.other is not None and live.layers == 4
    acct = account(model, src, Known(probes, first, memory, live), req)
    assert acct.memory is memory and acct.liveness is live
    assert acct.flops.total.has(L) and acct.symbols["L"] == 3
