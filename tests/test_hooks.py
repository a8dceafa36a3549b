"""Hooks on the user's model: derive traces the model rebuilt from its config, which has only the hooks its
constructor registers (``symacct.trace.hooks``). A hook registered afterwards (a forward hook keeping a module's
output, an optimizer step inside backward, a gradient hook) was lost without a word, and the figures were the
model's without it: the peak 896 bytes low for a kept output, 51 % high for the optimizer in backward. Such a
model is refused now, naming the hook; one whose constructor registers the hook is traced with it, exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import symacct
from symacct import SymacctError
from symacct.measure.run import measure_memory
from symacct.models import GPT2, GPT2Config

SMALL = dict(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)


def _kept(model: nn.Module) -> None:
    outputs: list[Any] = []
    model.blocks[0].register_forward_hook(lambda module, args, out: outputs.append(out))


def _freed(model: nn.Module) -> None:
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _doubled(model: nn.Module) -> None:
    for p in model.parameters():
        p.register_hook(lambda g: 2 * g)


@pytest.mark.parametrize(
    ("add", "kind", "module"),
    [(_kept, "forward hook on blocks.0 ", "blocks.0"), (_freed, "post-accumulate-grad hook", "wte"),
     (_doubled, "gradient hook on wte.weight", "wte")],
)  # fmt: skip
def test_a_hook_registered_after_construction_is_refused(add: Any, kind: str, module: str) -> None:
    model = GPT2(GPT2Config(**SMALL))
    symacct.derive(model)  # without the hook: derived
    add(model)
    with pytest.raises(SymacctError) as e:
        symacct.derive(model, optimizer="adamw")
    assert f"the given model has a {kind}" in e.value.what and e.value.module == module
    assert "register it where the model is built" in e.value.hint


@dataclasses.dataclass
class _StepConfig(GPT2Config):
    step_in_backward: bool = False


class _StepInBackward(GPT2):
    """GPT-2 with PyTorch's "optimizer in backward" recipe when its config asks: an AdamW per parameter, stepped
    by the parameter's post-accumulate-grad hook, which then frees the gradient, so no more than one gradient is
    alive at a time."""

    def __init__(self, config: _StepConfig) -> None:
        super().__init__(config)
        if config.step_in_backward:
            self.steppers = {p: torch.optim.AdamW([p], lr=1e-3) for p in self.parameters()}
            for p in self.parameters():
                p.register_post_accumulate_grad_hook(self._step)

    def _step(self, p: nn.Parameter) -> None:
        self.steppers[p].step()
        self.steppers[p].zero_grad(set_to_none=True)


def test_a_hook_the_constructor_registers_is_traced_and_exact() -> None:
    """The optimizer runs inside backward, parameter by parameter, and frees each gradient. The model rebuilt
    from the config registers the same hooks, so derive traces them, and the user's model is traced with its
    parameters' hooks copied (``fake_copy``; without them its backward ran no optimizer and it was refused as
    not the model given). Its figures against a real first step (the per-parameter optimizers' states made
    inside backward, as the real step makes them)."""
    torch.manual_seed(0)
    model = _StepInBackward(_StepConfig(**SMALL, step_in_backward=True))
    acct = symacct.derive(model)  # no optimizer after backward: the hooks step
    for B, S in [(2, 7), (3, 11)]:
        at = acct.at(B=B, S=S)
        torch.manual_seed(0)
        real = measure_memory(model, model.example_inputs(B, S))
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)
        assert at.memory.grads == real.grads == 0  # every gradient freed inside backward


def test_a_model_without_config_keeps_its_module_hooks_and_refuses_parameter_hooks() -> None:
    """Traced as a fake copy: a module's hooks are copied with it (traced, exact), a parameter's are not."""
    outputs: list[Any] = []

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def inputs(B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, 64),)

    model = net()
    model[1].register_forward_hook(lambda module, args, out: outputs.append(out))
    at = symacct.derive(model, inputs=inputs, loss=lambda out: out.sum(), optimizer="adamw").at(B=8, S=1)
    outputs.clear()
    real = measure_memory(model, inputs(8, 1), lambda m: torch.optim.AdamW(m.parameters()), loss=lambda o: o.sum())
    assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)

    model = net()
    _doubled(model)
    with pytest.raises(SymacctError) as e:
        symacct.derive(model, inputs=inputs, loss=lambda out: out.sum())
    assert "gradient hook on its parameter 0.weight" in e.value.what and e.value.module == "0"


@dataclasses.dataclass
class _ScaledConfig(GPT2Config):
    scale_gradients: bool = True


class _ScaledGradients(GPT2):
    """GPT-2 whose constructor registers a gradient hook on every parameter (a fixed gradient scale)."""

    def __init__(self, config: _ScaledConfig) -> None:
        super().__init__(config)
        if config.scale_gradients:
            for p in self.parameters():
                p.register_hook(_half)


def _half(g: torch.Tensor) -> torch.Tensor:
    return g / 2


def test_a_gradient_hook_the_constructor_registers_is_traced() -> None:
    """The hooks run in the trace: their ops in backward, the user's model traced with them (``fake_copy``).
    Where symacct's Python engine runs the backward (CUDA without a GPU), which runs no gradient hook, a hook
    already on a parameter is refused (``tests/test_engine.py``)."""
    model = _ScaledGradients(_ScaledConfig(**SMALL))
    unscaled = symacct.derive(_ScaledGradients(_ScaledConfig(**SMALL, scale_gradients=False)))
    scaled = symacct.derive(model)
    n = sum(p.numel() for p in model.parameters())
    assert scaled.at(B=2, S=7).flops.other_backward - unscaled.at(B=2, S=7).flops.other_backward == n  # a divide each


def test_a_forward_replaced_on_the_instance_is_refused() -> None:
    """``module.forward = types.MethodType(f, module)`` (a patch keeping the MLP's output) runs in the user's
    step only: the op counts match the rebuilt model's, the memory did not (896 bytes low after the forward)."""
    import types

    kept: list[Any] = []
    model = GPT2(GPT2Config(**SMALL))
    mlp = model.blocks[0].mlp

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = type(self).forward(self, x)
        kept.append(y)
        return y

    mlp.forward = types.MethodType(forward, mlp)
    with pytest.raises(SymacctError) as e:
        symacct.derive(model)
    assert "has a replaced method on blocks.0.mlp (forward -> " in e.value.what and e.value.module == "blocks.0.mlp"
