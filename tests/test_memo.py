"""The family memo (symacct.memo): a second derivation of a family reuses the probe traces and gives what a
fresh derivation gives; anything that changes the traced step (options, rules, a patched class) is derived
afresh."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch
from cases import build, gpt2_cases, llama_cases
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import symacct
from symacct import SymacctError, memo
from symacct.cost.rules import registry
from symacct.models import GPT2, GPT2Config
from symacct.models.gpt2 import MLP
from symacct.report import sheet
from symacct.symbols import sym

SMALL = GPT2Config(n_layer=3, n_head=2, n_embd=8, vocab_size=16, block_size=16)
OTHER = GPT2Config(n_layer=5, n_head=4, n_embd=32, vocab_size=64, block_size=32)


def _gpt2(cfg: GPT2Config) -> GPT2:
    with torch.device("meta"):
        return GPT2(cfg)


def _fresh(model: nn.Module, **options) -> symacct.Accounting:
    """A derivation with the memo switched off: everything traced."""
    memo.FAMILIES.enabled = False
    try:
        return symacct.derive(model, **options)
    finally:
        memo.FAMILIES.enabled = True


def _everything(acct: symacct.Accounting, S: int = 8) -> dict:
    """What a user reads off an accounting, as text: totals, memory formulas, notes, constraints, values at
    the model's sizes, the formula sheet."""
    mem = {f.name: str(getattr(acct.memory, f.name)) for f in dataclasses.fields(acct.memory)}
    at = acct.at(B=2, S=S)
    page = sheet.render_md(sheet.build(acct, name="gpt2", B=2))
    return {
        "flops": str(acct.flops),
        "memory": mem,
        "notes": list(acct.notes),
        "constraints": sorted(str(c) for c in acct.constraints),
        "symbols": dict(acct.symbols),
        "at": (str(at.flops), at.memory.peak, at.memory.activations, at.memory.peak_at),
        "nodes": acct.graph.number_of_nodes(),
        "sheet": page,
    }


def test_fingerprint_names_values_by_value_and_callables_by_identity():
    f, g = (lambda x: x), (lambda x: x)
    assert memo.fingerprint({"a": 1, "b": (2.0, "x")}) == memo.fingerprint({"a": 1, "b": (2.0, "x")})
    assert memo.fingerprint({"a": 1}) != memo.fingerprint({"a": 2})
    assert memo.fingerprint(1) != memo.fingerprint(True) and memo.fingerprint(1) != memo.fingerprint(1.0)
    assert memo.fingerprint(torch.bfloat16) != memo.fingerprint(torch.float16)
    assert memo.fingerprint(f) == memo.fingerprint(f) and memo.fingerprint(f) != memo.fingerprint(g)
    assert memo.fingerprint(SMALL) == memo.fingerprint(dataclasses.replace(SMALL))
    assert memo.fingerprint(SMALL) != memo.fingerprint(dataclasses.replace(SMALL, bias=not SMALL.bias))
    # tensors and modules are state that can change under one identity: no key, not memoised
    assert memo.fingerprint(torch.zeros(2)) is None
    assert memo.fingerprint({"plan": [nn.Linear(2, 2)]}) is None


def test_memo_keeps_the_most_recently_used():
    m = memo.Memo(size=2)
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1  # a is now the most recent
    m.put("c", 3)
    assert m.get("b") is None and m.get("a") == 1 and m.get("c") == 3
    assert (m.hits, m.misses, len(m)) == (3, 1, 2)
    m.put(None, 4)  # no key: nothing kept
    assert len(m) == 2
    m.drop("a")
    m.drop("a")  # already gone: not counted again
    assert m.stale == 1 and m.get("a") is None
    m.enabled = False
    m.put("d", 5)
    assert m.get("d") is None and m.get("c") is None


def test_another_size_of_a_family_is_memoised_and_gives_what_a_fresh_derivation_gives():
    symacct.derive(_gpt2(SMALL))
    assert (memo.FAMILIES.hits, memo.FAMILIES.misses, len(memo.FAMILIES)) == (0, 1, 1)
    got = symacct.derive(_gpt2(OTHER))
    assert memo.FAMILIES.hits == 1  # the probe traces were not taken again
    assert _everything(got) == _everything(_fresh(_gpt2(OTHER)))


def test_with_adamw_the_memoised_derivation_is_the_fresh_one():
    symacct.derive(_gpt2(SMALL), optimizer="adamw")
    got = symacct.derive(_gpt2(OTHER), optimizer="adamw")
    assert memo.FAMILIES.hits == 1
    assert _everything(got) == _everything(_fresh(_gpt2(OTHER), optimizer="adamw"))


def test_other_options_are_another_family():
    plain = symacct.derive(_gpt2(SMALL))
    adamw = symacct.derive(_gpt2(SMALL), optimizer="adamw")
    assert (memo.FAMILIES.hits, memo.FAMILIES.misses) == (0, 2)
    assert adamw.memory.optimizer != 0 and plain.memory.optimizer == 0


def test_each_accounting_has_its_own_memory_and_graph():
    a = symacct.derive(_gpt2(SMALL))
    b = symacct.derive(_gpt2(OTHER))
    assert memo.FAMILIES.hits == 1
    assert a.memory is not b.memory and a.memory.activations_by_module is not b.memory.activations_by_module
    assert a.graph is not b.graph
    a.memory.activations_by_module.clear()
    a.graph.clear()
    c = symacct.derive(_gpt2(OTHER))
    assert c.memory.activations_by_module and c.graph.number_of_nodes() == b.graph.number_of_nodes()


def test_a_class_patched_after_memoisation_is_derived_afresh():
    before = symacct.derive(_gpt2(SMALL))
    original = MLP.forward

    def forward(self, x):  # one more elementwise op a block, forward and backward
        return original(self, x) * 2.0

    with pytest.MonkeyPatch.context() as mp:  # a plain one: conftest's forgets the memo at each patch
        mp.setattr(MLP, "forward", forward)
        got = symacct.derive(_gpt2(SMALL))  # the memo's probe traces ran the old forward: the user's model differs
        assert (memo.FAMILIES.hits, memo.FAMILIES.stale) == (1, 1)  # found, compared, dropped, derived afresh
        assert got.flops.other_forward != before.flops.other_forward  # the new op counted
        assert _everything(got) == _everything(_fresh(_gpt2(SMALL)))


def test_a_constructor_patched_after_memoisation_is_derived_afresh():
    """The same ops at other sizes (an MLP 3D wide instead of 4D): the op comparison cannot see it, the
    parameters' shapes at the model's own sizes do."""
    before = symacct.derive(_gpt2(SMALL))

    def narrow(self, config):
        nn.Module.__init__(self)
        self.c_fc = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(3 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    with pytest.MonkeyPatch.context() as mp:  # a plain one: conftest's forgets the memo at each patch
        mp.setattr(MLP, "__init__", narrow)
        got = symacct.derive(_gpt2(SMALL))
        assert (memo.FAMILIES.hits, memo.FAMILIES.stale) == (1, 1)  # found, compared, dropped, derived afresh
        B, S, D, L = (sym(x) for x in "BSDL")
        # two matmuls a block each lose D*D of width per token: 2 * 2 * B*S*D^2 forward, twice that backward
        assert sympy.expand(got.flops.total - before.flops.total) == -12 * B * S * D**2 * L
        assert _everything(got) == _everything(_fresh(_gpt2(SMALL)))


def test_a_rule_replaced_is_another_family():
    before = symacct.derive(_gpt2(SMALL))
    packet = torch.ops.aten.addmm
    rule = registry._BY_OP[packet]

    def doubled(call):
        cost = rule(call)
        return dataclasses.replace(cost, flops=2 * cost.flops)

    with pytest.MonkeyPatch.context() as mp:  # a plain one: conftest's forgets the memo at each patch
        mp.setitem(registry._BY_OP, packet, doubled)
        got = symacct.derive(_gpt2(SMALL))
        assert (memo.FAMILIES.hits, memo.FAMILIES.misses) == (0, 2)  # the key names the rules
        assert got.flops.total != before.flops.total


def test_a_model_without_config_is_not_memoised():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for _ in range(2):
        symacct.derive(model, inputs=lambda m, B, S: (torch.randn(B, 8),), loss=lambda out: out.sum())
    assert len(memo.FAMILIES) == 0 and memo.FAMILIES.hits == 0


@pytest.mark.parametrize("L", [2, 96])
def test_a_memoised_derivation_traces_four_blocks_of_the_users_model_whatever_its_depth(L):
    from symacct import pipeline

    symacct.derive(_gpt2(SMALL))
    blocks = []
    original = pipeline._trace

    def counting(*a, **k):
        trace = original(*a, **k)
        blocks.append(len({r.module.split(".")[1] for r in trace.ops if r.module.startswith("blocks.")}))
        return trace

    with pytest.MonkeyPatch.context() as mp:  # a plain one: conftest's forgets the memo at each patch
        mp.setattr(pipeline, "_trace", counting)
        symacct.derive(_gpt2(dataclasses.replace(SMALL, n_layer=L)))
    assert memo.FAMILIES.hits == 1
    assert blocks == [min(L, 4)]  # one trace: the user's model, shortened (symacct.sameness)


def _hf_llama(hidden: int, layers: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")  # in the test extra; the skip shows when it is missing
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=3 * hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_a_transformers_family_is_memoised_and_gives_what_a_fresh_derivation_gives():
    symacct.derive(_hf_llama(64, 3))
    got = symacct.derive(_hf_llama(128, 6))
    assert (memo.FAMILIES.hits, memo.FAMILIES.stale) == (1, 0)
    assert _everything(got) == _everything(_fresh(_hf_llama(128, 6)))


@pytest.mark.slow
def test_gradient_checkpointing_switched_on_is_another_family():
    model = _hf_llama(64, 3)
    plain = symacct.derive(model)
    model.gradient_checkpointing_enable()  # on the modules, not in the config: carried to the probe model
    got = symacct.derive(model)
    assert (memo.FAMILIES.hits, memo.FAMILIES.misses) == (0, 2)
    assert got.flops.recompute != plain.flops.recompute  # the blocks run their forward again in backward
    assert _everything(got) == _everything(_fresh(model))


def test_a_function_is_named_with_what_it_captured_and_the_globals_it_reads():
    space = {"W": 8}
    read = eval("lambda m, B, S: (W * B,)", space)  # reads the global W
    before = memo.fingerprint({"inputs": read})
    space["W"] = 16  # reassigned between two derivations: another key
    assert memo.fingerprint({"inputs": read}) != before
    space["W"] = 8
    assert memo.fingerprint({"inputs": read}) == before

    def captured(w):
        return lambda m, B, S: (w * B,)

    f = captured(8)
    assert memo.fingerprint(f) == memo.fingerprint(f) != memo.fingerprint(captured(8))  # by identity too
    before = memo.fingerprint(f)
    f.__closure__[0].cell_contents = 16  # the captured value changed in place
    assert memo.fingerprint(f) != before
    assert memo.fingerprint(captured(nn.Linear(2, 2))) is None  # a module captured: not memoised


def test_an_autocast_the_caller_entered_is_refused_before_the_memo():
    """It was taken as another family; derive now refuses it (``pipeline.hermetic``: it cast the backward
    too, and the options did not say so), before the memo is asked."""
    symacct.derive(_gpt2(SMALL))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(SymacctError, match=r"inside torch.autocast\('cpu'"):
            symacct.derive(_gpt2(OTHER))
    assert (memo.FAMILIES.hits, memo.FAMILIES.misses) == (0, 1)


@st.composite
def _families(draw: st.DrawFn) -> tuple[nn.Module, nn.Module, int]:
    """Two configs of one family (every switch the same, the sizes drawn twice, degenerate ones included:
    H = 1, H_kv = H, heads of width 1, one block, a one-row position table) and an S both can run."""
    cfg, _, _ = draw(st.one_of(gpt2_cases(), llama_cases()))
    if isinstance(cfg, GPT2Config):
        H = draw(st.integers(1, 4))
        other = dataclasses.replace(
            cfg, n_layer=draw(st.integers(1, 6)), n_head=H, n_embd=H * draw(st.integers(1, 6)),
            vocab_size=draw(st.integers(2, 40)), block_size=draw(st.integers(1, 17)),
        )  # fmt: skip
        S = min(cfg.block_size, other.block_size)
    else:
        Hkv = draw(st.integers(1, 3))
        H = Hkv * draw(st.integers(1, 3))
        other = dataclasses.replace(
            cfg, n_layers=draw(st.integers(1, 6)), n_heads=H, n_kv_heads=Hkv, dim=H * 2 * draw(st.integers(1, 4)),
            vocab_size=draw(st.integers(2, 40)), hidden_dim=draw(st.integers(1, 30)),
            max_seq_len=draw(st.integers(1, 15)),
        )  # fmt: skip
        S = min(cfg.max_seq_len, other.max_seq_len)
    return build(cfg), build(other), S


@pytest.mark.slow  # four drawn families, three derivations each: the default suite's longest test (40 s)
@given(_families())
def test_a_memoised_derivation_is_the_fresh_one_at_any_sizes(pair):
    """Whatever the sizes of the family's first derivation and of the next (a memo hit, or a difference that
    derives afresh), the next gives what a fresh derivation gives: the same figures, or the same refusal (some
    small sizes run another attention path than the probe's, which derive's comparison refuses)."""
    first, other, S = pair
    memo.clear()
    try:
        symacct.derive(first, optimizer="adamw")
    except symacct.SymacctError:
        pass  # refused, memo or not: nothing memoised

    def derived(derive):
        try:
            return derive(other, optimizer="adamw"), S
        except symacct.SymacctError as e:
            return ("refused", e.what)

    got = derived(symacct.derive)
    fresh = derived(_fresh)
    if isinstance(got, tuple) and got[0] == "refused":
        assert got == fresh
    else:
        assert not (isinstance(fresh, tuple) and fresh[0] == "refused"), fresh
        assert _everything(*got) == _everything(*fresh)


def test_an_unhashable_callable_makes_no_key():
    class Unhashable:
        __slots__ = ()
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, out):
            return out

    assert memo.fingerprint({"loss": Unhashable()}) is None
