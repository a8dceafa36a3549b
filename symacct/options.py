"""Public option names in one place: dtypes by short name, optimizers by name.

A new dtype or optimizer is one line here; ``derive``, the command line, the
hardware catalog (peaks are keyed by these short names, plus ``tf32``, the
fp32 matmul mode) and the reports all read these tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from symacct.errors import SymacctError
from symacct.recipes import MixedPrecisionAdamW

# short name -> the torch dtypes it stands for (the first is the one the name selects)
DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "bf16": (torch.bfloat16,),
    "fp16": (torch.float16,),
    "fp32": (torch.float32,),
    "fp8": (torch.float8_e4m3fn, torch.float8_e5m2),
}
# other spellings of the short names ('torch.bfloat16' and 'bfloat16' come from DTYPES itself)
_SPELLINGS = {"half": "fp16", "float8": "fp8"}
# the dtypes a step can be traced in (autocast=, params_dtype=, --autocast, --params-dtype)
LOW_PRECISION = ("bf16", "fp16")
# the dtypes a KV cache can be held in (cache_dtype=, --cache-dtype): fp8 is float8_e4m3fn
CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8")

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adadelta": torch.optim.Adadelta,
    "mixed_adamw": MixedPrecisionAdamW,
}


def _names() -> dict[str, str]:
    out = dict(_SPELLINGS)
    for key, dtypes in DTYPES.items():
        out[key] = key
        for dt in dtypes:
            out[str(dt)] = key  # 'torch.bfloat16'
            out.setdefault(str(dt).removeprefix("torch."), key)  # 'bfloat16'
    return out


_NAMES = _names()


def dtype_key(dtype: torch.dtype | str | None, default: str = "fp32") -> str:
    """The short name of a dtype (``torch.bfloat16``, ``'torch.bfloat16'``, ``'bfloat16'``, ``'bf16'`` ->
    ``'bf16'``); ``default`` for None; an unknown name is returned as it is."""
    if dtype is None:
        return default
    return _NAMES.get(str(dtype), str(dtype))


def torch_dtype(
    arg: str, value: torch.dtype | str | None, names: tuple[str, ...] = ("bf16", "fp16", "fp32")
) -> torch.dtype | None:
    """A dtype given by short name (``'bf16'``, ``'fp16'``, ``'fp32'``; ``names`` says which) or as a
    torch.dtype; ``arg`` names the option in the error."""
    if isinstance(value, str):
        key = _NAMES.get(value)
        if key is None or key not in names:
            raise SymacctError(f"{arg}={value!r} is not a dtype name", hint="use " + ", ".join(names))
        return DTYPES[key][0]
    return value


def optimizer_factory(
    optimizer: str | type | None, options: Mapping[str, Any] | None
) -> Callable[[nn.Module], torch.optim.Optimizer] | None:
    """What builds the optimizer on a model: a name from ``OPTIMIZERS`` or a ``torch.optim.Optimizer``
    subclass, with ``options`` (``lr`` defaults to 1e-3); None for no optimizer."""
    if optimizer is None:
        if options:
            raise SymacctError("optimizer_options given without an optimizer", hint="pass optimizer='adamw' or a class")
        return None
    if isinstance(optimizer, str):
        cls = OPTIMIZERS.get(optimizer.lower())
        if cls is None:
            raise SymacctError(
                f"unknown optimizer {optimizer!r}", hint="one of: " + ", ".join(OPTIMIZERS) + ", or a class"
            )
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        cls = optimizer
    elif isinstance(optimizer, torch.optim.Optimizer):
        raise SymacctError(
            f"optimizer= got a {type(optimizer).__name__} instance; symacct builds the optimizer on its own model copy",
            hint=f"pass the class and its options: optimizer={type(optimizer).__name__}, "
            "optimizer_options={...} (e.g. the instance's defaults)",
        )
    else:
        shown = repr(optimizer).splitlines()[0][:80]
        raise SymacctError(f"not an optimizer: {shown}", hint="pass a torch.optim.Optimizer subclass or a name")
    opts = {"lr": 1e-3, **(options or {})}

    def make(model: nn.Module) -> torch.optim.Optimizer:
        try:
            return cls(model.parameters(), **opts)
        except (TypeError, ValueError) as e:
            raise SymacctError(f"could not build {cls.__name__}: {e}", hint="check optimizer_options") from e

    return make
