"""Strides the CPU kernels give an output otherwise than PyTorch's meta kernels (``symacct.trace.eager``,
``_CPU_GRAD_LAYOUT`` and ``_CPU_CONTIGUOUS_OUT``): a gradient that reaches layer norm, log-softmax or dropout
transposed, and a channels-last image through batch norm. Wrong strides are wrong bytes: a later reshape
copies in one and not in the other (transformers' Swin pools a transposed sequence; its peak was off by
1,024 bytes a sample before). Each model is exact against a real CPU step, and wrong without the rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from real_step import exact_against_a_real_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import symacct
from symacct.cost.graph import records

aten = torch.ops.aten


class _Clones(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.n += func is aten.clone.default
        return func(*args, **(kwargs or {}))


def _real_clones(model: nn.Module, *args: torch.Tensor) -> int:
    """``clone`` calls of a real forward and backward (under saved-tensor hooks, as symacct traces it)."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), _Clones() as c:
        model(*args).backward()
    model.zero_grad(set_to_none=True)
    return c.n


@dataclasses.dataclass
class SeqConfig:
    vocab: int = 40
    width: int = 12


class Pooled(nn.Module):
    """Layer norm, then only a pooler over the transposed sequence (Swin's): the gradient reaches layer norm
    transposed, and the linear layer before it reshapes what layer norm's backward returns (a view on the CPU,
    where it is contiguous)."""

    def __init__(self, config: SeqConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.fc = nn.Linear(config.width, config.width)
        self.norm = nn.LayerNorm(config.width)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(self.emb(x)))  # (B, S, W)
        pooled = self.pool(h.transpose(1, 2)).flatten(1)  # (B, W)
        return F.cross_entropy(self.out(pooled), y[:, 0])

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


@dataclasses.dataclass
class ImageConfig:
    channels: int = 6
    image_size: int = 8  # S
    classes: int = 5


class ChannelsLast(nn.Module):
    """A channels-last image through convolution, batch norm and a reshape (the CPU's batch norm keeps the
    image's memory format; symacct made it contiguous before)."""

    def __init__(self, config: ImageConfig) -> None:
        super().__init__()
        self.config = config
        self.conv = nn.Conv2d(3, config.channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(config.channels)
        self.out = nn.Linear(config.channels, config.classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x.contiguous(memory_format=torch.channels_last))))  # (B, C, S, S)
        h = h.reshape(h.shape[0], h.shape[1], -1).mean(-1)  # (B, C): copies a channels-last h
        return F.cross_entropy(self.out(h), y)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(B, 3, S, S), torch.randint(0, self.config.classes, (B,))


MODELS = [Pooled(SeqConfig()), ChannelsLast(ImageConfig())]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_layouts_are_the_cpu_kernels(model: nn.Module) -> None:
    """Exact against a real step, and running its copies: as many ``clone`` as the real step (with wrong strides
    the trace of ``Pooled`` copied layer norm's gradient before the linear layer's backward reshape)."""
    torch.manual_seed(0)
    acct = symacct.derive(model, optimizer="adamw")
    clones = sum(1 for _, n in records(acct.graph) if n.op == "aten.clone.default")
    assert clones == _real_clones(model, *model.example_inputs(2, 8))
    exact_against_a_real_step(model, acct, [(2, 8), (3, 16)])


def _layouts() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "contiguous": torch.randn(2, 4, 5, 6),
        "channels-last": torch.randn(2, 4, 5, 6).contiguous(memory_format=torch.channels_last),
        "permuted": torch.randn(2, 6, 5, 4).permute(0, 3, 2, 1),
        "channels-last by permute": torch.randn(2, 5, 6, 4).permute(0, 3, 1, 2),
        "transposed": torch.randn(2, 4, 6, 5).transpose(2, 3),
    }


def _kernels(x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input's gradient of each kernel in the table (and batch norm's forward), at input ``x`` and incoming
    gradient ``g``."""
    C, W = x.shape[1], x.shape[-1]
    out = {}
    y, mean, rstd = aten.native_layer_norm(x, [W], torch.ones(W), torch.zeros(W), 1e-5)
    out["layer norm"] = aten.native_layer_norm_backward(
        g, x, [W], mean, rstd, torch.ones(W), torch.zeros(W), [True] * 3
    )[0]
    y, m, v = aten.native_batch_norm(x, torch.ones(C), torch.zeros(C), None, None, True, 0.1, 1e-5)
    out["batch norm forward"] = y
    out["batch norm"] = aten.native_batch_norm_backward(g, x, torch.ones(C), None, None, m, v, True, 1e-5, [True] * 3)[
        0
    ]
    out["log-softmax"] = aten._log_softmax_backward_data(g, aten._log_softmax(x, -1, False), -1, x.dtype)
    out["dropout"] = aten.native_dropout_backward(g, x > 0, 2.0)
    dense = [t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) for t in (x, g)]
    if all(dense):  # the CPU kernel refuses another x, the meta kernel another g (it views g)
        y, mean, rstd = aten.native_group_norm(x, torch.ones(C), torch.zeros(C), 2, C, 30, 2, 1e-5)
        out["group norm"] = aten.native_group_norm_backward(g, x, mean, rstd, torch.ones(C), 2, C, 30, 2, [True] * 3)[0]
    return out


class _CpuLayouts(TorchDispatchMode):
    """What symacct's recorder does to each fake output: the CPU kernel's strides (``eager.strides``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        from symacct.trace import eager

        return eager.strides(func, args, func(*args, **(kwargs or {})))


def test_the_strides_are_the_cpu_kernels_for_every_layout() -> None:
    """Each kernel on real CPU tensors against the same on fake tensors with the recorder's strides, for every
    pair of input and incoming-gradient layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    xs, gs = _layouts(), _layouts()
    real = {(a, b): {k: t.stride() for k, t in _kernels(x, g).items()} for a, x in xs.items() for b, g in gs.items()}
    with FakeTensorMode():
        xs, gs = _layouts(), _layouts()
        with _CpuLayouts():
            fake = {
                (a, b): {k: t.stride() for k, t in _kernels(x, g).items()} for a, x in xs.items() for b, g in gs.items()
            }
    assert fake == real


class _Copies(TorchDispatchMode):
    """The copies (``clone``, ``copy_``) a real forward and backward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.n += func in (aten.clone.default, aten.copy_.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_model_converted_to_channels_last_after_construction(device: str) -> None:
    """``model.to(memory_format=torch.channels_last)`` after construction: the model rebuilt from its config is
    converted too (before, it was refused as "not the model given": its convolution's backward copied the
    weight's gradient, the converted model's does not), and a model on the meta device keeps the layout in its
    fake copy (before, it was copied contiguous, and derived as the model it was before the conversion).
    Exact against a real step of the converted model, running its copies."""
    torch.manual_seed(0)
    real = ChannelsLast(ImageConfig()).to(memory_format=torch.channels_last)
    with torch.device(device):
        model = ChannelsLast(ImageConfig()).to(memory_format=torch.channels_last)
    acct = symacct.derive(model, optimizer="adamw")
    copies = sum(
        1
        for _, n in records(acct.graph)
        if n.phase in ("forward", "backward") and n.op in ("aten.clone.default", "aten.copy_.default")
    )
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), _Copies() as c:
        real(*real.example_inputs(2, 8)).backward()
    real.zero_grad(set_to_none=True)
    assert copies == c.n
    exact_against_a_real_step(real, acct, [(2, 8), (3, 16)])
