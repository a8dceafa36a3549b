"""Which kernel ``F.scaled_dot_product_attention`` runs on CUDA: chosen by the caller, never guessed.

On a GPU, PyTorch picks a kernel (cuDNN, flash, memory-efficient or the math composite) from the compute
capability, the dtype, the head size, the mask, the cuDNN version and the order its release prefers; each
saves different tensors for backward (flash and cuDNN: the output and a logsumexp row per query; math:
the attention probabilities). On fake CUDA tensors without a GPU, PyTorch cannot ask the device and
falls back to the math kernel, which a GPU would rarely run: a silent wrong number. So there:

- ``backend=None``: a step that calls SDPA is refused, naming the choices;
- ``backend="flash" | "efficient" | "cudnn" | "math"``: that kernel is called, as PyTorch's
  ``scaled_dot_product_attention`` (``aten/src/ATen/native/transformers/attention.cpp``) calls it once
  chosen: flash pads the head dimension to a multiple of 8 and slices the output back, the fused kernels
  compute the logsumexp only when a gradient is wanted, the scale defaults to 1/sqrt(head dim). Under CUDA
  autocast the arguments are cast first and the kernel runs with autocast off, as autocast's wrapper does
  ahead of PyTorch's own choice (math then upcasts half inputs to fp32 and keeps them there).

With a GPU present, ``backend`` restricts PyTorch's own choice (``torch.nn.attention.sdpa_kernel``). On the
CPU it restricts the CPU's choice the same way: ``"flash"`` (PyTorch's CPU flash kernel, which saves the output
and a logsumexp row per query) or ``"math"`` (the composite, which saves the probabilities); the CPU has no
memory-efficient or cuDNN kernel, and those names are refused there (``check_backend``).
A mask is modelled for ``math`` only here, grouped-query heads left to ``enable_gqa`` for ``math``,
``flash`` and ``cudnn`` (whose kernels take fewer key/value heads as they are); the other cases are refused
without a GPU. The memory-efficient kernel's logsumexp holds ``32*ceiling(S/32)`` rows, read so
(``symacct.trace.record.padded_sizes``); flash's head-dim padding is refused where the model's own head dim
needs it and the probe's does not.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from symacct.errors import SymacctError
from symacct.trace.sdpa_choice import Target, choose, provenance

BACKENDS = ("flash", "efficient", "cudnn", "math")
_NAMES = {
    "flash": "flash attention",
    "efficient": "memory-efficient attention",
    "cudnn": "cuDNN attention",
    "math": "the math composite",
}


def describe(backend: str) -> str:
    return _NAMES[backend]


CPU_BACKENDS = ("flash", "math")


def check_backend(backend: str | None, device: str = "cuda") -> None:
    if backend is not None and backend not in BACKENDS:
        raise SymacctError(f"unknown SDPA backend {backend!r}", hint=f"one of {', '.join(BACKENDS)}")
    if backend is not None and torch.device(device).type == "cpu" and backend not in CPU_BACKENDS:
        raise SymacctError(
            f"sdpa_backend={backend!r} names a CUDA kernel, and the step runs on the CPU (device={device!r})",
            hint="on the CPU SDPA runs 'flash' (its CPU kernel) or 'math'; pass device='cuda' for CUDA's kernels",
        )


def _restricted(backend: str) -> contextlib.AbstractContextManager[None]:
    """PyTorch's choice of SDPA kernel restricted to ``backend`` (``torch.nn.attention.sdpa_kernel``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel([kinds[backend]])


def forced(device: str, target: Target | None) -> bool:
    """Whether ``choosing`` runs the step inside its torch-function mode (``_Forced``): on CUDA, with a named
    GPU's choice or without a GPU to ask."""
    return torch.device(device).type == "cuda" and (target is not None or not torch.cuda.is_available())


@contextlib.contextmanager
def choosing(
    backend: str | None, device: str, target: Target | None = None, size: Callable[[int], int] = int
) -> Iterator[dict[str, int]]:
    """The step's SDPA calls run ``backend``, or with ``target`` (a named GPU) the kernel PyTorch chooses on it
    (``symacct.trace.sdpa_choice``; ``size`` maps a traced dimension to the user's model's); on the CPU and on
    a GPU present, ``backend`` restricts PyTorch's own choice. Yields the kernels run, each described once with
    its count (filled as the calls run)."""
    check_backend(backend, device)
    counts: dict[str, int] = {}
    if not forced(device, target):
        if backend is None:
            yield counts
            return
        with _restricted(backend):
            yield counts
        return
    with _Forced(backend, target, size, counts):
        yield counts


class _Forced(TorchFunctionMode):
    """SDPA calls run the named kernel, or the one :func:`~symacct.trace.sdpa_choice.choose` picks for the
    target; the same path with and without a GPU."""

    def __init__(
        self, backend: str | None, target: Target | None, size: Callable[[int], int], counts: dict[str, int]
    ) -> None:
        super().__init__()
        self.backend, self.target, self.size, self.counts = backend, target, size, counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention and func is not torch._C._nn.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if self.backend is None and self.target is None:
            raise SymacctError(
                "the model calls scaled_dot_product_attention, whose kernel (and what it saves for backward) "
                "a GPU chooses; there is none here to ask",
                op="scaled_dot_product_attention",
                shapes=[tuple(a.shape) for a in args[:3] if isinstance(a, torch.Tensor)],
                hint="name the GPU with hardware= (CLI: --hardware) and symacct chooses as PyTorch does, or name "
                "the kernel with sdpa_backend='flash', 'cudnn', 'efficient' or 'math' (CLI: --sdpa-backend)",
            )
        autocast = torch.is_autocast_enabled("cuda")
        if autocast:
            # Autocast runs ahead of this mode on a GPU: SDPA is on its lower-precision list, so every floating
            # CUDA tensor argument but a float64 one (query, key, value, a float mask) is cast to the autocast
            # dtype, and the kernel runs with autocast off (autocast_mode.cpp, cached_cast and the excluded key)
            dtype = torch.get_autocast_dtype("cuda")
            args, kwargs = tuple(_cast(a, dtype) for a in args), {k: _cast(v, dtype) for k, v in kwargs.items()}
            torch.set_autocast_enabled("cuda", False)
        try:
            backend, why = self._kernel(*args, **kwargs)
            self.counts[why] = self.counts.get(why, 0) + 1
            return _call(backend, *args, **kwargs, _why=why, _size=self.size)
        finally:
            if autocast:
                torch.set_autocast_enabled("cuda", True)

    def _kernel(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        """The kernel and how the note describes it."""
        if self.backend is not None:
            return self.backend, f"{describe(self.backend)} (named by sdpa_backend)"
        assert self.target is not None
        a = inspect.signature(_call).bind("", *args, **kwargs)  # SDPA's own arguments, by name
        a.apply_defaults()
        q, k, v, mask, p, causal, gqa = (
            a.arguments[n] for n in ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "enable_gqa")
        )
        c = choose(self.target, q, k, v, mask, p, causal, gqa, self.size)
        passed = "".join(f"; not {describe(b)}: {why}" for b, why in c.passed)
        return c.backend, f"{describe(c.backend)} ({c.why}{passed}) on {self.target.name}, {provenance()}"


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    return value


def _call(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    _why: str = "",
    _size: Callable[[int], int] = int,
) -> torch.Tensor:
    if backend == "math":
        out = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )
        return out[0]
    # flash and cuDNN take fewer key/value heads as they are (attention.cpp passes key and value through)
    gqa = enable_gqa and query.size(-3) != key.size(-3)
    if attn_mask is not None or (gqa and backend not in ("flash", "cudnn")):
        raise _refusal(
            f"SDPA with {'a mask' if attn_mask is not None else 'grouped-query heads'} on {_why or describe(backend)}"
            " is not modelled",
            "scaled_dot_product_attention",
            (query, key, value),
            "name another kernel with sdpa_backend= (the figures are then that kernel's, not the GPU's choice), "
            "or measure on the GPU (symacct verify)",
        )
    head = query.size(-1)
    scale = 1.0 / math.sqrt(head) if scale is None else scale
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == "flash":
        own = _size(head)  # the user's model's head dim (a probe head is 8*29 wide: never padded)
        if own % 8 and not head % 8:
            raise _refusal(
                f"SDPA on {_why or describe(backend)}: the model's head dim {own} is padded to a multiple of 8 "
                "(copies of query, key and value), which the probe's head, a multiple of 8, does not show",
                "_scaled_dot_product_flash_attention",
                (query, key, value),
                "name another kernel with sdpa_backend= (its figures, not the GPU's choice), or measure on the GPU "
                "(symacct verify)",
            )
        pad = -head % 8
        if pad:
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0][..., :head] if pad else out[0]
    if backend == "efficient":  # with a gradient its logsumexp holds 32*ceiling(S/32) rows (Probe.pad)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, grad, dropout_p, is_causal, scale=scale
        )
        return out[0]
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, grad, dropout_p, is_causal, False, scale=scale
    )
    return out[0]


def _refusal(text: str, op: str, tensors: tuple[torch.Tensor, ...], hint: str) -> SymacctError:
    """The error for an SDPA call this module does not model, naming the op and the query/key/value shapes."""
    return SymacctError(text, op=op, shapes=[tuple(t.shape) for t in tensors], hint=hint)
