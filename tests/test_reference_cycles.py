"""Tensors only reference cycles hold: derive names them, and a real step holds what it counts.

An autograd Function that keeps its output as an attribute of ``ctx`` (``ctx.y = y``) makes a cycle: ``y``'s
``grad_fn`` is the node that holds ``ctx``. Reference counting never frees it; Python's cycle collector does,
at a time of its own. Derive counts with the collector paused (``symacct.trace.record.no_cycle_collection``),
so such tensors are held as long as a cycle holds them, and its note says which ops made them. A real step
measured by ``symacct.measure.run`` pauses the collector too: the comparison is then exact, where with the
collector running it would depend on when a collection happens to come. Under non-reentrant checkpointing the
cycle is made by the recomputation in the backward and survives the step's end; without checkpointing it
lives as long as the step's graph, which the loss holds to the end of the step, and then outlives it.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import symacct
from symacct.measure.run import measure_memory_steps
from symacct.measure.verify import verify


class TanhOnCtx(torch.autograd.Function):
    """tanh that keeps its output as ``ctx.y`` (not through ``save_for_backward``): a reference cycle."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.y = y  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * (1 - ctx.y * ctx.y)  # type: ignore[attr-defined]


class TanhSaved(torch.autograd.Function):
    """The same through ``save_for_backward``: no cycle."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * (1 - y * y)


class Net(nn.Module):
    """Embedding, ``depth`` residual blocks (LayerNorm, Linear, tanh, Linear), a vocabulary head."""

    def __init__(self, V: int, D: int, L: int, tanh: type[torch.autograd.Function], ckpt: bool) -> None:
        super().__init__()
        self.tanh, self.ckpt = tanh, ckpt
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)) for _ in range(L)
        )
        self.head = nn.Linear(D, V)

    def block(self, blk: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        return blk[2](self.tanh.apply(blk[1](blk[0](x))))  # (B, S, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, S, D)
        for blk in self.blocks:
            h = h + (checkpoint(self.block, blk, h, use_reentrant=False) if self.ckpt else self.block(blk, h))
        return F.cross_entropy(self.head(h).flatten(0, 1), idx.flatten())


def _tokens(model: Net, B: int, S: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, model.emb.num_embeddings, (B, S), generator=torch.Generator().manual_seed(B * S)),)


DIMS = {"V": 64, "D": 32, "L": 2}


def _derive(tanh: type[torch.autograd.Function], ckpt: bool) -> symacct.Accounting:
    return symacct.derive(lambda V, D, L: Net(V, D, L, tanh, ckpt), dims=DIMS, inputs=_tokens, optimizer="adamw")


def _mismatches(acct: symacct.Accounting, tanh: type[torch.autograd.Function], ckpt: bool, B: int, S: int, L: int):
    torch.manual_seed(0)
    rows = verify(
        Net(DIMS["V"], DIMS["D"], L, tanh, ckpt),
        acct,
        B=B,
        S=S,
        sizes={"L": L},
        inputs=_tokens,
        optimizer=lambda m: torch.optim.AdamW(m.parameters()),
    )
    return [f"{r.name}: derived {r.predicted}, measured {r.measured}" for r in rows if not r.ok]


def test_a_cycle_the_recomputation_makes_is_named_and_counted_held():
    """Checkpointed blocks whose Function keeps its output on ctx: the backward's recomputation leaves its
    graph in cycles, with the block's input and every tensor it made. Before, derive said nothing, and a
    real step read less at every phase after the backward whenever a collection came (at (B, S, L) = (3, 7,
    3): 32,760 bytes less after the optimizer step, of 252,280)."""
    acct = _derive(TanhOnCtx, ckpt=True)
    cycles = [n for n in acct.notes if "reference cycles" in n]
    assert len(cycles) == 1 and "held only by reference cycles at the step's end" in cycles[0], acct.notes
    assert "aten.tanh.default in 'blocks.*" in cycles[0] and "(backward)" in cycles[0]
    for B, S, L in [(2, 3, 2), (3, 7, 3)]:
        assert not _mismatches(acct, TanhOnCtx, True, B, S, L)


def test_a_cycle_that_outlives_the_step_is_named():
    """Without checkpointing the cycle lives as long as the step's graph, which the loss holds to the step's
    end: the figures are a real step's either way, and the note says the tensors outlive the step."""
    acct = _derive(TanhOnCtx, ckpt=False)
    cycles = [n for n in acct.notes if "reference cycles" in n]
    assert len(cycles) == 1 and "aten.tanh.default in '<root>' (forward) outlive the step" in cycles[0]
    assert "held only by reference cycles at the step's end" not in cycles[0]
    assert not _mismatches(acct, TanhOnCtx, False, 2, 3, 2)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_no_cycle_no_note(ckpt):
    """The same Function through save_for_backward makes no cycle, checkpointed or not: no note."""
    acct = _derive(TanhSaved, ckpt)
    assert not [n for n in acct.notes if "reference cycles" in n], acct.notes
    assert not _mismatches(acct, TanhSaved, ckpt, 2, 3, 2)


class CollectorSeen(nn.Module):
    """A Linear that records, at each call, whether Python's cycle collector is on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return self.lin(x).sum()


def test_a_measured_step_runs_with_the_collector_paused():
    """A real step measured for verify runs with the collector paused, as derive counts, and gives it back as
    it was: when a collection comes would otherwise decide what a cycle-held tensor reads (with the default
    thresholds the checkpointed model above read 32,760 bytes less after the optimizer step at (3, 7, 3),
    with a collection every allocation it read none less: each young cycle had moved to an older generation
    before it became garbage)."""
    model, was = CollectorSeen(), gc.isenabled()
    gc.enable()
    try:
        measure_memory_steps(model, (torch.randn(2, 4),), lambda m: torch.optim.SGD(m.parameters()), 2)
        assert model.seen == [False, False] and gc.isenabled()
    finally:
        if not was:
            gc.disable()
