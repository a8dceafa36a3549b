"""Losses, a gated unit and interpolation that had no cost rule ("no cost rule for aten.mse_loss"): a model
using them derives, exact against a real step, and each kernel costs its definition's arithmetic, counted
here by hand (docs/conventions.md, "Losses" and "Interpolation")."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch
import torch.nn.functional as F
from real_step import exact_against_a_real_step
from torch import nn

import symacct
from symacct.cost.graph import records
from symacct.symbols import sym


@dataclasses.dataclass
class HeadsConfig:
    vocab: int = 50
    width: int = 16


class Heads(nn.Module):
    """A gated layer, linear and bilinear upsampling with a pixel (un)shuffle, and seven elementwise losses of
    the logits against one-hot targets (mean, sum and none reductions)."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.gate = nn.Linear(config.width, 2 * config.width)
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.gate(self.emb(x)), -1)  # (B, S, W)
        line = F.interpolate(h.transpose(1, 2), scale_factor=2, mode="linear")  # (B, W, 2S)
        img = F.interpolate(line[..., None], scale_factor=(1, 2), mode="bilinear")  # (B, W, 2S, 2)
        img = F.pixel_shuffle(F.pixel_unshuffle(img, 2), 2)  # (B, W, 2S, 2)
        h = h + F.avg_pool1d(img.sum(-1), 2).transpose(1, 2)  # (B, S, W)
        z = self.out(h)  # (B, S, V)
        t = (y[..., None] == torch.arange(self.config.vocab)).float()  # (B, S, V) one-hot
        return (
            F.mse_loss(z, t)
            + F.mse_loss(z, t, reduction="none").mean()
            + F.smooth_l1_loss(z, t)
            + F.huber_loss(z, t, reduction="sum")
            + F.soft_margin_loss(z, 2 * t - 1)
            + F.binary_cross_entropy_with_logits(z, t)
            + F.binary_cross_entropy(torch.sigmoid(z), t)
        )

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


@pytest.fixture(scope="module")
def heads() -> tuple[Heads, symacct.Accounting]:
    model = Heads(HeadsConfig())
    return model, symacct.derive(model, optimizer="adamw")


def test_losses_gates_and_interpolation_are_exact_against_a_real_step(heads):
    exact_against_a_real_step(*heads)


def test_each_kernel_costs_its_definition(heads):
    """FLOPs per element, from each definition's arithmetic (a forward that reduces adds 1 per element)."""
    _, acct = heads
    B, S, V, W = sym("B"), sym("S"), sym("vocab"), sym("width")
    N = B * S * V  # elements of the logits
    want = {
        "mse_loss": (2 + 1) * N + 2 * N,  # (x - y)^2, reduced by the op; then with reduction="none"
        "mse_loss_backward": 2 * 3 * N,  # (x - y) * (2 / N) * grad, for each
        "smooth_l1_loss": (5 + 1) * N,
        "smooth_l1_loss_backward": 5 * N,
        "huber_loss": (5 + 1) * N,
        "huber_loss_backward": 5 * N,
        "soft_margin_loss": (5 + 1) * N,  # log(1 + exp(-y x))
        "soft_margin_loss_backward": 6 * N,
        "binary_cross_entropy_with_logits": (12 + 1) * N,  # PyTorch's stable form
        "binary_cross_entropy": (8 + 1) * N,
        "binary_cross_entropy_backward": 6 * N,
        "glu": 2 * B * S * W,  # 1 per input element (sigmoid of the gate half, times the value half)
        "glu_backward": 6 * B * S * W,  # per gradient element
        "upsample_linear1d": 3 * B * W * 2 * S,  # 2 taps: 2 mul + 1 add per output element
        "upsample_linear1d_backward": 4 * B * W * 2 * S,  # 2 weighted adds per gradient element
        "upsample_bilinear2d": 7 * B * W * 2 * S * 2,  # 4 taps
        "upsample_bilinear2d_backward": 8 * B * W * 2 * S * 2,
        "pixel_shuffle": 0,  # a permutation: a copy
        "pixel_unshuffle": 0,
    }
    got: dict[str, sympy.Expr] = {}
    for _, n in records(acct.graph):
        name = n.op.split(".")[1] if n.op.startswith("aten.") else n.op
        if name in want:
            got[name] = got.get(name, sympy.Integer(0)) + n.cost.flops_other * n.count
    assert set(got) == set(want)
    for name, k in want.items():
        assert sympy.expand(got[name] - k) == 0, (name, got[name])


@dataclasses.dataclass
class OneLossConfig:
    vocab: int = 50
    width: int = 16
    loss: str = "mse_loss"


class OneLoss(nn.Module):
    """The step's loss is the loss kernel's own output, held by the caller through the backward: the four
    kernels that keep the input-sized storage they computed in (resized to a scalar) hold it that long."""

    def __init__(self, config: OneLossConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.out(self.emb(x))  # (B, S, V)
        t = (y[..., None] == torch.arange(self.config.vocab)).float()  # (B, S, V)
        if self.config.loss == "binary_cross_entropy":
            return F.binary_cross_entropy(torch.sigmoid(z), t)
        if self.config.loss == "soft_margin_loss":
            return F.soft_margin_loss(z, 2 * t - 1, reduction="sum")
        if self.config.loss == "huber_loss":
            return F.huber_loss(z, t, reduction="none").mean()
        return getattr(F, self.config.loss)(z, t)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "soft_margin_loss", "binary_cross_entropy", "l1_loss"])
def test_a_reduced_loss_holds_the_storage_its_kernel_keeps(loss):
    """Their meta kernels give the reduced loss a one-element storage; the eager kernels (CPU measured here; the
    CUDA path shares the code that resizes) keep B * S * V elements, all through the backward. l1_loss
    reduces into a fresh scalar, as its meta kernel says."""
    model = OneLoss(OneLossConfig(loss=loss))
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)
    B, S, V = sym("B"), sym("S"), sym("vocab")
    mem, inputs = acct.memory, 2 * 8 * B * S  # two int64 (B, S) inputs
    loss_bytes = 4 * B * S * V if loss != "l1_loss" else 4  # the loss, held after the backward
    assert sympy.expand(mem.after_backward - mem.params - mem.grads - inputs - loss_bytes) == 0


MIXED = ["mse_loss", "smooth_l1_loss", "soft_margin_loss", "huber_loss", "binary_cross_entropy"]


@pytest.mark.parametrize("loss", MIXED)
def test_a_bfloat16_prediction_against_a_float32_target(loss):
    """bfloat16 parameters, float32 targets. The CPU kernels give the loss (huber, soft margin) and the
    prediction's gradient (mse, smooth L1, soft margin) the prediction's dtype, where PyTorch's meta kernels
    promote to float32 (and autograd would then add a cast the real step does not run); binary cross entropy
    (forward) and Huber (backward) refuse two dtypes on the CPU, so the real step fails, and derive refuses."""
    torch.manual_seed(0)
    model = OneLoss(OneLossConfig(loss=loss)).to(torch.bfloat16)
    if loss in ("huber_loss", "binary_cross_entropy"):
        with pytest.raises(RuntimeError, match="Found dtype"):
            model(*model.example_inputs(2, 7)).backward()
        with pytest.raises(symacct.SymacctError, match="refuses two dtypes") as e:
            symacct.derive(model, params_dtype="bf16")
        assert e.value.op.startswith(f"aten.{loss}")
        return
    exact_against_a_real_step(model, symacct.derive(model, optimizer="adamw", params_dtype="bf16"))
