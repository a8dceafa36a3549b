"""Memory formulas against what PyTorch really holds on a real CPU step.

- params, grads and optimizer-state bytes: the sizes of the real tensors after
  a real step, exactly;
- after forward / after backward / after the optimizer step (and
  zero_grad(set_to_none=True)): symacct's storage tracker (``symacct.measure.run``),
  exactly;
- peak: exactly as well. symacct's trace watches every fake storage through
  a weak reference, so its lifetimes are eager's own (Python locals included:
  an optimizer's ``denom`` lives until the next parameter overwrites it);
  a "last use" model would miss that by up to one parameter's size.

Sizes are drawn >= 2 (see test_saved_bytes.py for why size 1 differs).
"""

from __future__ import annotations

import dataclasses
import importlib
from functools import cache

import pytest
import sympy
import torch
from cases import (
    _SMALL,
    OPTIMIZERS,
    build,
    cruncher_cases,
    derived,
    derived_with_optimizer,
    gpt2_cases,
    llama_cases,
    sizes,
    switches,
)
from hypothesis import given
from hypothesis import strategies as st

import symacct
from symacct.measure.run import measure_memory_steps, measure_step
from symacct.models import GPT2, GPT2Config, LlamaConfig
from symacct.options import OPTIMIZERS as OPTIMIZERS_BY_NAME

_OPT_CLASSES = OPTIMIZERS_BY_NAME  # the classes derive builds from the same names


def check(case, opt_choice) -> None:
    cfg, B, S = case
    opt, opts = opt_choice
    acct = derived_with_optimizer(cfg, opt, opts)
    model = build(cfg)
    torch.manual_seed(0)
    args = model.example_inputs(B, S)
    steps = measure_memory_steps(model, args, lambda m: _OPT_CLASSES[opt](m.parameters(), lr=1e-3, **dict(opts)), 3)
    real = steps[0]
    got = acct.at(B=B, S=S, **sizes(cfg)).memory
    assert (got.params, got.grads, got.optimizer) == (real.params, real.grads, real.optimizer)
    assert (got.after_forward, got.after_backward, got.after_optimizer) == (
        real.after_forward,
        real.after_backward,
        real.after_optimizer,
    )
    assert got.peak == real.peak
    _check_steady(acct, steps[1:], B=B, S=S, **sizes(cfg))


def _check_steady(acct, later, **values) -> None:
    """Steps after the first: the same step with the optimizer states alive from its start."""
    steady = acct.steady(**values)
    for m in later:
        assert steady == {k: getattr(m, k) for k in ("after_forward", "after_backward", "after_optimizer", "peak")}


@given(gpt2_cases(lo=2))
def test_steps_without_an_optimizer_accumulate_their_gradients(case):
    """Without an optimizer nothing frees the gradients: a later step starts with the last one's and adds its own
    into them (each new gradient lives until AccumulateGrad takes it in). ``steady`` said a later step was the
    first again: for a two-layer GPT-2 (D = 32, V = 64, B = 2, S = 3) its memory after the forward came out
    112,128 bytes low, the gradients' bytes, and ``peak_every_step`` gave 241,256 bytes where the later steps
    peak at 282,930."""
    cfg, B, S = case
    acct = derived(cfg)
    model = build(cfg)
    torch.manual_seed(0)
    steps = measure_memory_steps(model, model.example_inputs(B, S), None, 3)
    got = acct.at(B=B, S=S, **sizes(cfg)).memory
    assert (got.after_forward, got.after_backward, got.peak) == (
        steps[0].after_forward,
        steps[0].after_backward,
        steps[0].peak,
    )
    _check_steady(acct, steps[1:], B=B, S=S, **sizes(cfg))
    assert acct.peak_every_step(B=B, S=S, **sizes(cfg)) == max(m.peak for m in steps)


@given(gpt2_cases(lo=2), st.sampled_from(OPTIMIZERS))
def test_gpt2_memory(case, opt):
    check(case, opt)


@given(llama_cases(lo=2), st.sampled_from(OPTIMIZERS))
def test_llama_memory(case, opt):
    check(case, opt)


@given(cruncher_cases(lo=2), st.sampled_from(OPTIMIZERS))
def test_cruncher_memory(case, opt):
    check(case, opt)


def test_adamw_fp32_is_16_bytes_per_parameter():
    """4 (weights) + 4 (grads) + 4 (m) + 4 (v), read off the derived formulas' leading terms."""
    import sympy

    acct = symacct.derive(
        GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)), optimizer="adamw"
    )
    mem = acct.memory
    N = acct.params
    # leading terms: every term of N has a counterpart 4x (weights), 4x (grads), 8x (m, v)
    assert sympy.expand(mem.params - 4 * N) == 0
    assert sympy.expand(mem.grads - 4 * N) == 0
    # AdamW also keeps one fp32 `step` tensor per parameter tensor: 4 bytes each, not per element
    n_tensors = sum(1 for n, a in acct.graph.nodes(data=True) if isinstance(n, str) and n.startswith("param:"))
    steps = mem.optimizer_by_state["step"]
    assert sympy.expand(mem.optimizer - 8 * N - steps) == 0
    assert steps.subs(sympy.Symbol("L", integer=True, positive=True), 4) == 4 * n_tensors


def test_memtracker_agrees_with_the_formulas():
    """PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) as a second witness, on CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    acct = derived_with_optimizer(GPT2Config(), "adamw", ())
    cfg = GPT2Config(n_layer=3, n_embd=48, n_head=4, vocab_size=96, block_size=24)
    model = GPT2(cfg)
    args = model.example_inputs(3, 20)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(model, opt, *args)
    cpu = torch.device("cpu")
    with tracker:
        loss = model(*args)
        after_forward = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        loss.backward()
        after_backward = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_optimizer = tracker.get_tracker_snapshot("current")[cpu]["Total"]
    peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    got = acct.at(B=3, S=20, **sizes(cfg)).memory
    assert (got.after_forward, got.after_backward, got.after_optimizer, got.peak) == (
        after_forward,
        after_backward,
        after_optimizer,
        peak,
    )


def test_bytes_per_parameter_come_out_of_derive():
    """fp32 AdamW: 4 + 4 + 4 + 4 = 16; the seeds' bf16 mixed recipe: 2 + 2 + 12 = 16; fp32 grads: 18; SGD: 8."""
    small = GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)
    cases = [
        ({"optimizer": "adamw"}, 16),
        ({"optimizer": "sgd"}, 8),
        ({"optimizer": "sgd", "optimizer_options": {"momentum": 0.9}}, 12),
        ({"optimizer": "mixed_adamw", "params_dtype": torch.bfloat16}, 16),
        ({"optimizer": "mixed_adamw", "params_dtype": torch.bfloat16, "optimizer_options": {"fp32_grads": True}}, 18),
    ]
    for kwargs, expected in cases:
        assert symacct.derive(GPT2(small), **kwargs).bytes_per_param() == expected, kwargs


@given(gpt2_cases(lo=2), st.booleans())
def test_mixed_precision_recipe_memory(case, fp32_grads):
    from symacct.recipes import MixedPrecisionAdamW

    cfg, B, S = case
    acct = _mixed(switches(cfg), fp32_grads)
    model = build(cfg).to(torch.bfloat16)
    torch.manual_seed(0)
    args = model.example_inputs(B, S)
    steps = measure_memory_steps(model, args, lambda m: MixedPrecisionAdamW(m.parameters(), fp32_grads=fp32_grads), 3)
    got = acct.at(B=B, S=S, **sizes(cfg)).memory
    fields = ("params", "grads", "optimizer", "after_forward", "after_backward", "after_optimizer", "peak")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(steps[0], f) for f in fields}
    _check_steady(acct, steps[1:], B=B, S=S, **sizes(cfg))


@cache
def _mixed(sw, fp32_grads: bool) -> symacct.Accounting:
    model = build(dataclasses.replace(_SMALL[GPT2Config], **dict(sw)))
    return symacct.derive(
        model, params_dtype=torch.bfloat16, optimizer="mixed_adamw", optimizer_options={"fp32_grads": fp32_grads}
    )


def test_optimizers_symacct_cannot_account_are_refused():
    small = GPT2(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, block_size=8))
    with pytest.raises(symacct.SymacctError, match="optimizer step failed on fake tensors"):
        symacct.derive(small, optimizer=torch.optim.LBFGS)  # needs a closure

    class GlobalState(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            self.state["norm"] = {"total": torch.zeros(())}  # not keyed by a parameter

    with pytest.raises(symacct.SymacctError, match="not keyed by a parameter"):
        symacct.derive(small, optimizer=GlobalState)
    with pytest.raises(symacct.SymacctError, match="unknown optimizer"):
        symacct.derive(small, optimizer="adamx")


class _Looped(torch.nn.Module):
    """Each loop iteration makes a root-level copy before its block (as torch 2.11's checkpoint makes
    two empty tensors per call): ops outside the blocks that repeat with L."""

    def __init__(self, width: int, L: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x * 2.0))  # x * 2.0 runs in the root module, once per block
        return x.sum()


def _looped_inputs(model, B, S):
    return (torch.randn(B, model.blocks[0].in_features),)


@pytest.mark.parametrize("L", [2, 3, 7])
def test_ops_between_blocks_are_factored_by_L(L):
    acct = symacct.derive(_Looped, dims={"width": 6, "L": 3}, inputs=_looped_inputs, optimizer="adamw")
    assert "L" in acct.free_symbols() and not any("unfactored" in n for n in acct.notes)
    model = _Looped(6, L)
    real = measure_memory_steps(model, _looped_inputs(model, 4, 1), lambda m: torch.optim.AdamW(m.parameters()), 1)
    at = acct.at(B=4, width=6, L=L)
    got = at.memory
    assert [getattr(got, k) for k in ("after_forward", "after_backward", "after_optimizer", "peak")] == [
        getattr(real[0], k) for k in ("after_forward", "after_backward", "after_optimizer", "peak")
    ]
    counted = measure_step(_Looped(6, L), _looped_inputs(model, 4, 1))
    assert (at.flops.forward, at.flops.backward, got.activations) == (
        counted.flops_forward,
        counted.flops_backward,
        counted.saved_bytes,
    )


def test_unaligned_layer_stack_falls_back_to_a_fixed_L(monkeypatch):
    """When one block's removal does not align the traces, L is fixed rather than a peak guessed."""
    import symacct.cost.layers
    import symacct.memory.liveness

    monkeypatch.setattr(symacct.memory.liveness, "align_layers", lambda *a: None)
    acct = symacct.derive(_Looped, dims={"width": 6, "L": 5}, inputs=_looped_inputs, optimizer="adamw")
    assert "L fixed at its value" in acct.notes[0] and "L" not in acct.free_symbols()
    model = _Looped(6, 5)
    real = measure_memory_steps(model, _looped_inputs(model, 3, 1), lambda m: torch.optim.AdamW(m.parameters()), 1)
    got = acct.at(B=3, width=6).memory
    assert (got.after_forward, got.after_backward, got.peak) == (
        real[0].after_forward,
        real[0].after_backward,
        real[0].peak,
    )


def _traces_and_memory(model, monkeypatch, **kw):
    """Derive counting the traces taken; the memory formulas and exact peaks at a few sizes."""
    import symacct.trace.record

    calls = []
    real = symacct.trace.record.record_step

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(importlib.import_module("symacct.pipeline"), "record_step", counting)
    acct = symacct.derive(model, **kw)
    m = acct.memory
    formulas = [m.after_forward, m.after_backward, m.after_optimizer, m.peak]
    peaks = [acct.at(B=b, S=s, L=L).memory.peak for b, s, L in ((1, 7, 1), (3, 5, 2), (2, 9, 6))]
    return len(calls), formulas, peaks


_BORROW_CASES = [
    GPT2Config(n_layer=3, n_head=2, n_embd=8, vocab_size=16, block_size=16, checkpoint=True),
    LlamaConfig(n_layers=2, n_heads=4, n_kv_heads=2, dim=16, hidden_dim=24, vocab_size=16, max_seq_len=16),
]


@pytest.mark.parametrize("cfg", _BORROW_CASES, ids=["gpt2-checkpointed", "llama-gqa"])
def test_one_block_more_borrowed_from_the_checking_trace(cfg, monkeypatch):
    """The liveness of one block more comes from the trace that checks the formulas at other sizes, its bytes
    borrowed from the first trace (6 traces: probe, the user's model at its longest lengths, at its shortest
    with B = 2, at B = 1 and at S = 1, the check); where a storage has no counterpart, a seventh trace at the
    first probe's sizes is taken instead.
    Both routes give the same formulas and the same exact peaks (which test_*_memory checks against real
    steps)."""
    import symacct.memory.liveness

    model = build(cfg)
    n, formulas, peaks = _traces_and_memory(model, monkeypatch, optimizer="adamw")
    assert n == 6
    monkeypatch.setattr(symacct.memory.liveness, "one_block_less", lambda name, stacks: name)  # no counterpart by name
    n2, formulas2, peaks2 = _traces_and_memory(model, monkeypatch, optimizer="adamw")
    assert n2 == 7
    assert (formulas2, peaks2) == (formulas, peaks)


def test_a_borrowed_formula_must_give_the_bytes_counted(monkeypatch):
    """A storage whose borrowed formula does not evaluate to the bytes the checking trace counted is refused
    (None: derive then traces one block more at the first probe's sizes)."""
    import symacct.cost.layers
    import symacct.memory.liveness

    seen = []
    real = symacct.memory.liveness.liveness

    def keeping(*a, **k):
        seen.append((a, k))
        return real(*a, **k)

    monkeypatch.setattr(importlib.import_module("symacct.pipeline"), "liveness", keeping)
    symacct.derive(build(_BORROW_CASES[0]))
    (base, other, probe, stacks, layers), kw = seen[0]
    iv = symacct.memory.liveness.intervals(base, probe)
    align = symacct.cost.layers.align_layers(base, other, stacks, layers)
    values = kw["other_values"]
    assert symacct.memory.liveness.borrowed_intervals(other, base, iv, align, stacks, values) is not None
    st = next(s for s in iv.nbytes if s in base.saved_storages)
    iv.nbytes[st] = iv.nbytes[st] * 2
    assert symacct.memory.liveness.borrowed_intervals(other, base, iv, align, stacks, values) is None


def test_sweep_of_the_peak_is_exact_where_the_sampled_envelope_is_not():
    """memory.peak's formula is the envelope of the points largest somewhere in a sample; at sizes the sample
    missed it lies below the peak (the GPT-2 reference: AdamW's temporaries for a large embedding when D is
    small). sweep("memory.peak") evaluates every op's live bytes there, as at() does."""
    import numpy as np

    from symacct.models.presets import PRESETS
    from symacct.symbols import evaluate

    cls, make = PRESETS["gpt2"]
    with torch.device("meta"):
        model = cls(make())
    acct = symacct.derive(model, optimizer="adamw", autocast="bf16")
    points = [dict(B=6, S=3, L=5, D=27, H=27, V=6124, S_max=7), dict(B=8, S=1024, L=12, D=768, H=12, V=50257)]
    arrays = {k: np.array([p.get(k, acct.symbols.get(k)) for p in points]) for k in points[0]}
    swept = acct.sweep("memory.peak", **arrays)
    exact = [acct.at(**p).memory.peak for p in points]
    assert swept.tolist() == exact and swept.dtype == np.int64
    assert evaluate(acct.memory.peak, points[0]) < exact[0]  # the envelope's miss that sweep must not copy


class _SavesItsInput(torch.nn.Module):
    """Blocks whose activation saves its input and a buffer (LogSigmoid), so that a block's output is saved
    only by the next block's Linear: the last block's output, summed into the loss, by nothing."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        w = config.width  # type: ignore[attr-defined]
        n = config.n_layers  # type: ignore[attr-defined]
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.LogSigmoid()) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, width)
        for block in self.blocks:
            x = block(x)  # (B, width)
        return x.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.width),)  # type: ignore[attr-defined]


@dataclasses.dataclass
class _WidthConfig:
    width: int = 16
    n_layers: int = 3


@pytest.mark.parametrize(("L", "B"), [(2, 3), (3, 5), (6, 2)])
def test_a_block_output_saved_only_by_the_next_block(L: int, B: int) -> None:
    """Each block saves three (B, width) tensors, but the last block's output is saved by no one: the
    derived activations count it once less (against saved_tensors_hooks on the real model)."""
    from symacct.measure.run import measure_step

    acct = symacct.derive(_SavesItsInput(_WidthConfig()))
    model = _SavesItsInput(_WidthConfig(n_layers=L))
    counted = measure_step(model, model.example_inputs(B, 1)).saved_bytes
    assert acct.at(B=B, L=L).memory.activations == counted
    mem = acct.memory
    (per_layer,) = mem.activations_per_layer.values()
    total = sympy.expand(symacct.symbols.sym("L") * per_layer + sum(mem.activations_outside.values()))
    assert total == mem.activations


def test_gradients_taken_where_accumulate_grad_runs() -> None:
    """``grad_ready``: each parameter's gradient is taken by AccumulateGrad at a ``detach`` of its storage
    after the op that made it, once per gradient; a linear layer's weight gradient is taken after its
    node's last op (the bias gradient's sum), not at the op after the one that made it: a later
    micro-batch's gradient lives that long before it is added in (the 1F1B stage peaks of
    ``tests/test_parallel.py::test_gloo_pipeline`` are exact with it, 40 bytes low without)."""
    from symacct.memory.liveness import grad_ready

    acct = symacct.derive(GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)))
    trace, labels = acct.step, acct.liveness.labels
    taken = grad_ready(trace)
    assert set(taken) == set(trace.grad_storages)
    for storage, t in taken.items():
        assert labels[t][1] == "aten.detach.default" and t > trace.storage_producer[storage]
    gaps = {trace.grad_storages[g]: t - trace.storage_producer[g] for g, t in taken.items()}
    assert gaps["blocks.0.mlp.c_fc.weight"] > 2 and acct.liveness.grad_taken == taken


class _Mode(torch.nn.Module):
    """A layer that notes the mode each forward runs in (``seen``), and drops out in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return self.drop(self.lin(x)).sum()


@pytest.mark.parametrize("how", ["measure_step", "train", "forward"])
def test_measuring_gives_each_module_its_own_mode_back(how: str) -> None:
    """The measuring functions run the step in the step's mode (train, or eval for an inference step) and then
    give every module its mode back: a caller's model in eval mode, with one submodule in train mode, comes
    back so (before, it came back all in train mode, or all in eval mode)."""
    from symacct.measure.run import measure_memory

    model = _Mode().eval()
    model.drop.train()
    x = torch.ones(2, 4)
    if how == "measure_step":
        measure_step(model, (x,))
    else:
        measure_memory(model, (x,), step=how)
    assert model.seen == [how != "forward"]  # the step ran in its own mode
    assert (model.training, model.lin.training, model.drop.training) == (False, False, True)


@dataclasses.dataclass
class _PooledConfig:
    width: int = 16
    n_layers: int = 2


class _Pooled(torch.nn.Module):
    """Blocks, then a pooler whose output no loss reads (transformers' BigBird masked LM builds its pooler and
    drops its output): ``tanh`` saves its output for a backward that never runs."""

    def __init__(self, config: _PooledConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(config.width, config.width) for _ in range(config.n_layers))
        self.pool = torch.nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, width)
        for block in self.blocks:
            x = block(x).relu()
        pooled = torch.tanh(self.pool(x[:, 0]))  # (B, width): dropped when forward returns
        del pooled
        return x.square().mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_what_a_branch_the_loss_never_reads_saves_is_freed_with_it() -> None:
    """The pooler's saved output is freed when forward returns, as eager PyTorch frees it. symacct's pack hook
    kept it, closing a reference cycle through its grad_fn: memory after the forward and the peak came out
    B * width * 4 bytes high (``symacct.trace.versions.alias``). Its saved bytes still count as saved."""
    from real_step import exact_against_a_real_step

    model = _Pooled(_PooledConfig())
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)
