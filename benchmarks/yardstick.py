"""The yardstick of issue 13, shared by the derive benchmarks: a gpt2-small training step (L = 12) on meta
tensors under FlopCounterMode, and the same step derived.

Each function builds its model first and times only the pass (or the derive), in seconds. The package's
names load on first use, so the derive module is imported here, before any timer. Each timed section runs
as ``timeit`` runs its statement: after a full garbage collection, with the collector paused (derive pauses
it anyway; a collection of the process's objects inside the FlopCounterMode pass would add tenths of a
second to it, at random).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct.models import GPT2, GPT2Config

_ = symacct.derive  # the package's names load on first use: loaded here, before any timer


MEDIUM = {"n_embd": 1024, "n_head": 16}  # gpt2-medium's widths: another member of the family


def gpt2(L: int = 12, **widths: int) -> GPT2:
    """gpt2-small on the meta device (``widths``: other config fields, such as ``MEDIUM``)."""
    with torch.device("meta"):
        return GPT2(GPT2Config(n_layer=L, **widths))


def flop_counter_pass(adamw: bool = False, **widths: int) -> float:
    """One FlopCounterMode pass of the step (B=1, S=1024), with AdamW's step when ``adamw``."""
    model = gpt2(**widths)
    with torch.device("meta"):
        idx = torch.zeros(1, model.config.block_size, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters()) if adamw else None
    with timed() as seconds:
        with FlopCounterMode(display=False):
            model(idx, idx).backward()
            if opt is not None:
                opt.step()
    return seconds()


def derive_seconds(adamw: bool = False, **widths: int) -> float:
    """One derive of the step, with AdamW when ``adamw`` (the memory pass is part of every derive)."""
    model = gpt2(**widths)
    with timed() as seconds:
        symacct.derive(model, optimizer="adamw" if adamw else None)
    return seconds()


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    """The wall time of the block (read after it), as ``timeit`` takes it: a full collection first, the
    collector paused inside."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    t = time.perf_counter()
    end: list[float] = []
    try:
        yield lambda: end[0] - t
    finally:
        end.append(time.perf_counter())
        if was:
            gc.enable()


def median_time(fn, repeats: int = 3) -> float:
    """The median wall time of ``repeats`` calls of ``fn``, in seconds."""
    import statistics

    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
