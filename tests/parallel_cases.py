"""Module-level builders for the multi-process tests (``torch.multiprocessing.spawn`` pickles them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.models.llama import Llama, LlamaConfig

GPT2_SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=10, vocab_size=37, block_size=16, dropout=0.0)
GPT2_PIPE = dataclasses.replace(GPT2_SMALL, n_layer=4, tie_weights=False)
# wide enough that the step's peak is at the start of backward (the activations), not in the optimizer
GPT2_WIDE = dataclasses.replace(GPT2_SMALL, n_layer=4, n_head=4, n_embd=64, vocab_size=512, block_size=64)
LLAMA_SMALL = LlamaConfig(dim=12, n_layers=2, n_heads=3, n_kv_heads=1, vocab_size=29, hidden_dim=20, max_seq_len=16)


@dataclasses.dataclass(frozen=True)
class Build:
    """A reference model from its config (picklable)."""

    config: Any

    def __call__(self) -> nn.Module:
        return GPT2(self.config) if isinstance(self.config, GPT2Config) else Llama(self.config)


@dataclasses.dataclass(frozen=True)
class KilledOnRank:
    """``Build`` whose process ``rank`` is ended by SIGKILL while building (as the out-of-memory killer ends
    one): no traceback, no error file."""

    config: Any
    rank: int

    def __call__(self) -> nn.Module:
        import os
        import signal

        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return Build(self.config)()


@dataclasses.dataclass(frozen=True)
class CrashOnRank:
    """``Build`` whose process ``rank`` aborts while building (a native crash: SIGABRT, no traceback), the
    first ``times`` worlds only: each crash leaves a file in ``marks``."""

    config: Any
    rank: int
    marks: str
    times: int = 1

    def __call__(self) -> nn.Module:
        import os
        from pathlib import Path

        import torch.distributed as dist

        if dist.get_rank() == self.rank and len(list(Path(self.marks).iterdir())) < self.times:
            Path(self.marks, f"crash{len(list(Path(self.marks).iterdir()))}").touch()
            os.abort()
        return Build(self.config)()


@dataclasses.dataclass(frozen=True)
class Batch:
    """B x S token ids and targets, the same on every rank."""

    B: int
    S: int
    vocab: int

    def __call__(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.vocab, (self.B, self.S), generator=g)
        return ids, torch.randint(0, self.vocab, (self.B, self.S), generator=g)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def stage(model: nn.Module, s: int, pp: int) -> nn.Module:
    return model.pipeline_stage(s, pp)


class HFLoss(nn.Module):
    """A transformers causal LM whose call returns the loss (what the fake-process-group runner calls)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        import transformers

        self.lm = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


def _exit_at_once() -> None:
    """End a gloo rank that passed without the interpreter's teardown, as ``gloo_world``'s ranks end: gloo's
    worker threads may still hold tensors that teardown would destroy (pytorch/pytorch#179291), which aborts
    the process now and then (SIGABRT, seen once in a CI run of ``reduce_scatter_peak``)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(fn: Any, args: tuple[Any, ...], store: Any) -> None:
    """``fn(rank, store, *args)`` on two spawned gloo processes, run once more (with a RuntimeWarning) if one
    was ended by a native crash (SIGABRT, SIGSEGV, SIGBUS), as ``gloo_world`` does; a failure again, or any
    other failure, is raised. ``store``: a fresh path per attempt is made under it."""
    import signal
    import warnings

    import torch.multiprocessing as mp

    for attempt in (1, 2):
        try:
            mp.spawn(fn, args=(str(store / f"store{attempt}"), *args), nprocs=2, join=True)
            return
        except mp.ProcessExitedException as e:
            crashed = e.signal_name in {signal.Signals(s).name for s in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)}
            if attempt == 2 or not crashed:
                raise
            warnings.warn(f"a gloo rank ended by {e.signal_name}: run once more", RuntimeWarning, stacklevel=2)


def released_collective_buffers(rank: int, store: str, rounds: int) -> None:
    """A gloo rank issuing functional collectives under a ``StorageTracker``: once the program drops a
    collective's input and output, the very next op reads them freed, every round (no race with gloo's
    worker thread, which lets go of a finished collective an instant after the waiter wakes)."""
    import torch.distributed as dist

    from symacct.measure.run import StorageTracker

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD.group_name
        fc = torch.ops._c10d_functional
        with StorageTracker([]) as tracker:
            for i in range(rounds):
                x = torch.ones(256)  # 1 KiB
                y = fc.all_reduce(x, "sum", group) if i % 2 else fc.all_gather_into_tensor(x, 2, group)
                y = fc.wait_tensor(y)
                del x, y
                z = torch.zeros(1)
                assert tracker.current() == 4, (i, tracker.current())  # z alone
                del z
    finally:
        dist.destroy_process_group()
    _exit_at_once()


def reduce_scatter_peak(rank: int, store: str) -> None:
    """A gloo rank reduce-scattering 1 KiB into 512 B under a ``StorageTracker``, as FSDP2 does (c10d's
    ``reduce_scatter_tensor``): the peak is the input and the output, as on NCCL; gloo's own flat copy of the
    input (an all-reduce's buffer it splits afterwards) is left out."""
    import torch.distributed as dist

    from symacct.measure.run import StorageTracker

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        x = torch.ones(256)
        with StorageTracker([x]) as tracker:
            out = torch.empty(128)
            dist.reduce_scatter_tensor(out, x)
            peak = tracker.peak
        assert peak == 1024 + 512, peak  # gloo's copy counted: 1024 more
        assert out.eq(2).all()
    finally:
        dist.destroy_process_group()
    _exit_at_once()
