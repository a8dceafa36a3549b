"""A gradient taken inside the forward (a gradient penalty, a physics-informed loss): with
``torch.autograd.grad(..., create_graph=True)`` it derives and is exact against a real step; with
``torch.func.grad`` (which refuses saved-tensor hooks, and symacct counts saved tensors through them) it is
refused for that reason (before, as a failure "at probe sizes", with a hint about head counts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

import symacct
from symacct.measure.run import measure_memory


@dataclasses.dataclass
class InnerConfig:
    width: int = 8


class Penalty(nn.Module):
    """The loss plus the squared gradient of the output by the input, taken in the forward with a graph."""

    def __init__(self, config: InnerConfig) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()  # (B, S, W)
        y = self.lin(x).tanh().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)  # (B, S, W)
        return (g**2).mean() + y

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


class FuncGrad(Penalty):
    """The same gradient through ``torch.func.grad``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.func.grad(lambda y: self.lin(y).tanh().sum())(x)  # (B, S, W)
        return (g**2).mean()


class _Flops(TorchDispatchMode):
    """Matmul FLOPs by torch.utils.flop_counter's formulas, op by op. FlopCounterMode itself cannot count this
    step: its module tracker's gradient hooks refuse a ``torch.autograd.grad`` inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in flop_registry:
            shape = lambda x: x.shape if isinstance(x, torch.Tensor) else x  # noqa: E731
            self.total += flop_registry[func.overloadpacket](
                *tree_map(shape, args), **tree_map(shape, kwargs), out_val=tree_map(shape, out)
            )
        return out


def test_a_gradient_penalty_is_exact_against_a_real_step() -> None:
    torch.manual_seed(0)
    model = Penalty(InnerConfig())
    acct = symacct.derive(model, optimizer="adamw")
    for B, S in ((2, 7), (3, 11)):
        at = acct.at(B=B, S=S)
        with _Flops() as counted:
            model(*model.example_inputs(B, S)).backward()
        model.zero_grad(set_to_none=True)
        assert at.flops.hardware == counted.total
        real = measure_memory(model, model.example_inputs(B, S), lambda m: torch.optim.AdamW(m.parameters()))
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)


def test_torch_func_grad_in_the_forward_is_refused_for_its_hooks() -> None:
    model = FuncGrad(InnerConfig())
    model(*model.example_inputs(2, 7)).backward()  # PyTorch runs it, without saved-tensor hooks
    with pytest.raises(symacct.SymacctError, match="refuses saved-tensor hooks") as e:
        symacct.derive(model)
    assert "torch.autograd.grad(..., create_graph=True)" in e.value.hint
