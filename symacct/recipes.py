"""Training recipes that are not a single torch.optim class, written as optimizers so
that ``derive`` traces them like any other (their ``step()`` runs on fake tensors).

``MixedPrecisionAdamW``: the seeds' mixed-precision recipe. The model's
parameters and gradients are low precision (build it with
``params_dtype=torch.bfloat16``); the optimizer keeps fp32 master weights and
fp32 Adam moments, steps them, and copies the result back:
2 (bf16 weights) + 2 (bf16 grads) + 4 (master) + 4 (m) + 4 (v) = 16 bytes per
parameter. With ``fp32_grads=True`` gradients are accumulated into an fp32
``main_grad`` as backward produces them (Megatron's choice), and the bf16
gradient is dropped: 2 + 4 + 4 + 4 + 4 = 18 bytes per parameter. The fp32
buffer is kept between steps (as Megatron's grad buffer is) and overwritten by
the first backward after a step, so each step uses the gradients accumulated
since the last one (micro-batches), never those of earlier steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MixedPrecisionAdamW(torch.optim.Optimizer):
    """AdamW on fp32 master copies of low-precision parameters (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        fp32_grads: bool = False,
    ) -> None:
        params = list(params)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fp32_grads = fp32_grads
        masters = []
        for p in params:
            self.state[p]["master"] = p.detach().float()  # fp32 master weights
            masters.append(self.state[p]["master"])
            if fp32_grads:
                p.register_post_accumulate_grad_hook(self._accumulate_fp32)
        self.inner = torch.optim.AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _accumulate_fp32(self, p: torch.Tensor) -> None:
        state = self.state[p]
        if "main_grad" not in state:
            state["main_grad"] = p.grad.float()
        elif state.get("main_grad_consumed", False):  # the first backward after a step: start afresh
            state["main_grad"].copy_(p.grad)
        else:
            state["main_grad"].add_(p.grad)
        state["main_grad_consumed"] = False
        p.grad = None

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            state = self.state[p]
            if self.fp32_grads:
                if not state.get("main_grad_consumed", True):  # gradients since the last step, if any
                    state["master"].grad = state["main_grad"]
                state["main_grad_consumed"] = True
            elif p.grad is not None:
                state["master"].grad = p.grad.float()
        self.inner.step()
        for p in params:
            state = self.state[p]
            p.copy_(state["master"])
            state["master"].grad = None
            state.update(self.inner.state[state["master"]])  # m, v and step, per parameter
