"""The Python autograd engine (``symacct.trace.engine``) against PyTorch's, on CPU fake tensors.

The engine exists for fake CUDA tensors on a machine without a GPU, where PyTorch's engine cannot start;
there it cannot be compared with anything but itself. On the CPU both run, so both trace the same step
and every op (name, module, phase, output shapes), every saved storage and every storage's death must
be the same: the order of the nodes, the gradients' sums and fits, when saved tensors are released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_loops import LoopConfig, Reentrant

from symacct.models import GPT2, Cruncher, CruncherConfig, GPT2Config, Llama, LlamaConfig, ResNet, ResNetConfig
from symacct.recipes import MixedPrecisionAdamW
from symacct.trace.record import StepTrace, record_step


def _gpt2(**kw: Any) -> Callable[[], torch.nn.Module]:
    return lambda: GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32, **kw))


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters())


class _ScaledGelu(torch.autograd.Function):
    """gelu(x) * scale * w for a float ``scale`` between two tensors: its backward returns a gradient per forward
    input, None for the float, where its node has an edge per tensor input (x's, then w's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return torch.nn.functional.gelu(x) * scale * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        x, w = ctx.saved_tensors
        gx = torch.ops.aten.gelu_backward(g * ctx.scale * w, x)
        gw = (g * torch.nn.functional.gelu(x) * ctx.scale).sum((0, 1))
        return gx, None, gw


class _Gated(torch.nn.Module):
    """A linear layer, then the custom Function with a weight of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledGelu.apply(self.lin(x), 0.5, self.w).sum()  # (B, S, 8) -> ()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, 8),)


class _Shifted(torch.nn.Module):
    """A view of a product changed in place (``add_``, which saves nothing), then read: its node is replaced
    as on a real tensor (``symacct.trace.views``), by a hook on PyTorch's engine and by the Python engine."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.lin(x) * 2  # (B, S, 32)
        w = u.view(x.shape[0], x.shape[1], 4, 8).add_(1)  # (B, S, 4, 8), a view changed in place
        return u.sum() + w.mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, 8),)


CASES: dict[str, tuple[Callable[[], torch.nn.Module], dict[str, Any]]] = {
    "gpt2": (_gpt2(), {}),
    "gpt2-adamw-bf16-autocast": (_gpt2(), {"optimizer": _adamw, "autocast": torch.bfloat16}),
    "gpt2-checkpoint": (_gpt2(checkpoint=True), {"optimizer": _adamw}),
    "gpt2-sdpa": (_gpt2(sdpa=True), {"optimizer": _adamw, "autocast": torch.bfloat16}),
    "gpt2-mixed-recipe": (  # fp32 grads made by post-accumulate-grad hooks
        _gpt2(),
        {"optimizer": lambda m: MixedPrecisionAdamW(m.parameters()), "params_dtype": torch.bfloat16},
    ),
    "llama": (
        lambda: Llama(
            LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=64, max_seq_len=32)
        ),
        {"optimizer": _adamw},
    ),
    "cruncher-sgd": (
        lambda: Cruncher(CruncherConfig(dim=16, n_layers=3)),
        {"optimizer": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)},
    ),
    "resnet": (lambda: ResNet(ResNetConfig(width=8, num_classes=10, blocks=(1, 1))), {"optimizer": _adamw}),
    "custom-function": (lambda: _Gated(), {"optimizer": _adamw}),
    # a view's node after an in-place op, replaced as on a real tensor (symacct.trace.views)
    "in-place-view": (lambda: _Shifted(), {"optimizer": _adamw}),
}


def _trace(make: Callable[[], torch.nn.Module], python_engine: bool, **kw: Any) -> StepTrace:
    def build(fake: Any) -> torch.nn.Module:
        with fake:
            return make()

    return record_step(build, lambda m: m.example_inputs(2, 16), python_engine=python_engine, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_python_engine_runs_the_step_pytorchs_engine_runs(case: str) -> None:
    make, kw = CASES[case]
    real, ours = _trace(make, False, **kw), _trace(make, True, **kw)

    def ops(t: StepTrace) -> list[tuple[str, str, str, tuple[tuple[int, ...], ...]]]:
        return [(str(r.op), r.module, r.phase, tuple(tuple(m.shape) for m in r.outputs)) for r in t.ops]

    assert ops(ours) == ops(real)
    assert any(r.phase == "backward" for r in real.ops)
    assert ours.storage_end == real.storage_end
    assert ours.saved_storages == real.saved_storages
    assert ours.grad_storages == real.grad_storages


def test_the_cpu_build_refuses_cuda_before_touching_it() -> None:
    """On the CPU build a fake CUDA tensor aborts the process at its first device guard: refused first."""
    from symacct.errors import SymacctError
    from symacct.trace.record import check_device

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: device='cuda' is taken")
    with pytest.raises(SymacctError, match="CUDA build of torch"):
        check_device("cuda")
    with pytest.raises(SymacctError, match="cannot trace for device"):
        check_device("mps")
    check_device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["gpt2-adamw-bf16-autocast", "gpt2-checkpoint", "llama"])
def test_on_a_gpu_the_two_engines_trace_the_same_cuda_step(case: str) -> None:
    """With a GPU, PyTorch's engine runs fake CUDA tensors too: the route taken without a GPU (the Python
    engine) must trace the same step."""
    make, kw = CASES[case]
    real, ours = _trace(make, False, device="cuda", **kw), _trace(make, True, device="cuda", **kw)
    assert [(str(r.op), r.module) for r in ours.ops] == [(str(r.op), r.module) for r in real.ops]
    assert ours.storage_end == real.storage_end and ours.saved_storages == real.saved_storages


def test_hooks_the_python_engine_would_not_run_are_refused() -> None:
    """A gradient hook on a tensor, or a module's full backward hook, runs inside PyTorch's engine only: a
    step that registers one is refused on the Python engine (and traced as before on PyTorch's)."""
    from symacct.errors import SymacctError

    class Hooked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y.register_hook(lambda g: g)
            return y.sum()

        def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
            return (torch.randn(B, 8),)

    with pytest.raises(SymacctError, match="gradient hook"):
        _trace(Hooked, True)
    assert _trace(Hooked, False).ops

    def with_module_hook() -> torch.nn.Module:
        m = Cruncher(CruncherConfig(dim=8, n_layers=2))
        m.layers[0].register_full_backward_hook(lambda mod, gi, go: None)
        return m

    with pytest.raises(SymacctError, match="module backward hook"):
        _trace(with_module_hook, True)

    def with_parameter_hook() -> torch.nn.Module:  # registered before the step: it was skipped without a word
        m = Cruncher(CruncherConfig(dim=8, n_layers=2))
        m.layers[1].weight.register_hook(lambda g: 2 * g)
        return m

    with pytest.raises(SymacctError, match="parameter layers.1.weight has a gradient hook") as e:
        _trace(with_parameter_hook, True)
    assert e.value.module == "layers.1"
    assert _trace(with_parameter_hook, False).ops
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: g)  # restored after the trace: registering works again


def test_a_backward_run_by_a_node_is_refused_on_the_python_engine() -> None:
    """Reentrant checkpointing runs a backward over the block it recomputed, from inside its node; PyTorch's
    engine frees what that backward's nodes saved as each runs, which the Python engine cannot: refused there
    with what to do (and traced on PyTorch's engine, exact: tests/test_loops.py)."""
    from symacct.errors import SymacctError

    def make() -> torch.nn.Module:
        return Reentrant(LoopConfig(n_layers=2))

    with pytest.raises(SymacctError, match="use_reentrant=False"):
        _trace(make, True)
    assert any(r.phase == "recompute" for r in _trace(make, False).ops)
