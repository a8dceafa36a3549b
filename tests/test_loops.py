"""What a model's layer loop does around its blocks, exact against a real step at a depth below the probe's
four blocks and at one above it (whose trace of the user's model keeps blocks 0, 1, 2 and the last):

- reentrant checkpointing (``checkpoint(block, h, use_reentrant=True)``): the block's forward runs again in
  the backward, and a nested backward runs the nodes it made, the gradient of its detached input included.
  Those nodes were given no module (they were made in the backward), so their ops were counted outside the
  layer stack once, and the model was refused as "not the model given" or as size-dependent control flow;
- a block called twice in one iteration, with work between the calls (``F.normalize(blk(h)) * blk(h)``):
  the work between the calls ran outside every block, once per layer, and was refused the same way;
- a loop over the sequence in each layer (a recurrent cell stepped over S, by index or by ``unbind``): its
  op count grows with S, so it is refused, now in the first probe trace, as soon as the loop has read every
  position (``symacct.trace.loops``). Before, the two probe traces at primes in the hundreds took minutes
  (this GRU cell about 110 s, then refused for another cause; transformers' Mamba over five, unanswered).
  Loops that read some positions, or a constant dimension, and an ``unbind`` whose pieces go to one op,
  stay exact. PyTorch's own ``nn.RNN`` and ``nn.GRU`` step through time the same way on the CPU and are
  refused the same way (``nn.GRU`` was refused for an op with no rule, after its traces).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from real_step import exact_against_a_real_step
from torch import nn

import symacct


@dataclasses.dataclass
class LoopConfig:
    vocab: int = 50
    width: int = 16
    n_layers: int = 2


class Loop(nn.Module):
    """Embedding, ``n_layers`` blocks run by ``mix`` in the root's loop, a head and cross-entropy."""

    def __init__(self, config: LoopConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList([self.block(config) for _ in range(config.n_layers)])
        self.out = nn.Linear(config.width, config.vocab)

    def block(self, c: LoopConfig) -> nn.Module:
        return nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(), nn.Linear(4 * c.width, c.width))

    def mix(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, S, W)
        for block in self.blocks:
            h = self.mix(block, h)  # (B, S, W)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


class Reentrant(Loop):
    def mix(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h + cp.checkpoint(block, h, use_reentrant=True)  # (B, S, W)


class NonReentrant(Loop):
    def mix(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h + cp.checkpoint(block, h, use_reentrant=False)  # (B, S, W)


class Twice(Loop):
    def mix(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        a = F.normalize(block(h), dim=-1)  # (B, S, W)
        return h + a * F.cosine_similarity(h, block(h), dim=-1)[..., None]  # (B, S, W)


@pytest.mark.parametrize("L", [2, 5])
@pytest.mark.parametrize("cls", [Reentrant, Twice])
def test_the_loop_around_the_blocks_is_exact(cls: type[Loop], L: int) -> None:
    torch.manual_seed(0)
    model = cls(LoopConfig(n_layers=L))
    acct = symacct.derive(model, optimizer="adamw")
    assert "L" in acct.symbols  # factored by L, not kept at the model's depth
    exact_against_a_real_step(model, acct)


def test_reentrant_checkpointing_recomputes_the_whole_block_and_saves_its_input_only() -> None:
    """Against non-reentrant checkpointing of the same blocks: the same saved bytes (each block's input),
    and the recomputation of every block's forward, where the non-reentrant one stops once the tensors the
    backward needs are made again (the second linear's product is never needed)."""
    torch.manual_seed(0)
    re = symacct.derive(Reentrant(LoopConfig(n_layers=3))).at(B=2, S=7)
    non = symacct.derive(NonReentrant(LoopConfig(n_layers=3))).at(B=2, S=7)
    W, N = 16, 2 * 7  # width, tokens
    assert re.memory.activations == non.memory.activations
    second_linear = 2 * N * 4 * W * W  # its matmul, per block
    assert re.flops.recompute - non.flops.recompute == 3 * second_linear


class Recurrent(Loop):
    """Each block a GRU cell stepped over the sequence in Python, by index or by iterating the pieces of an
    ``unbind``: size-dependent control flow."""

    def __init__(self, config: LoopConfig, by: str = "index") -> None:
        self.by = by
        super().__init__(config)

    def block(self, c: LoopConfig) -> nn.Module:
        return nn.GRUCell(c.width, c.width)

    def mix(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(h[:, 0])  # (B, W)
        steps = (h[:, t] for t in range(h.shape[1])) if self.by == "index" else h.unbind(1)
        outs = []
        for x_t in steps:  # S steps: (B, W) each
            state = block(x_t, state)
            outs.append(state)
        return torch.stack(outs, 1)  # (B, S, W)


@pytest.mark.parametrize("by", ["index", "unbind"])
def test_a_loop_over_the_sequence_is_refused_in_the_first_trace(by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    traces = []
    real = symacct.pipeline.record_step
    monkeypatch.setattr(symacct.pipeline, "record_step", lambda *a, **k: traces.append(1) or real(*a, **k))
    with pytest.raises(symacct.SymacctError) as e:
        symacct.derive(Recurrent(LoopConfig(), by=by))
    assert "reads a dimension of S index by index" in e.value.what and "size-dependent" in e.value.what
    assert e.value.sizes == ("S",) and e.value.module == ""  # the loop runs in the root's mix
    assert len(traces) == 1  # the first probe trace, stopped in its first block


class Positions(Loop):
    """Loops that do not grow with a size: the first three positions read one by one, each of three
    channels of a constant dimension, and every position unbound and stacked again by one op."""

    def mix(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        first = sum(h[:, t] for t in range(3))  # (B, W): three positions, whatever S is
        rgb = h[..., : 3 * (h.shape[-1] // 3)].unflatten(-1, (3, -1))  # (B, S, 3, W/3)
        scale = sum(rgb[:, :, c].mean() for c in range(3))  # every index of a constant dimension
        again = torch.stack(h.unbind(1), 1)  # (B, S, W): the pieces go to one op
        return block(again) * scale + first[:, None]


def test_loops_that_do_not_grow_with_a_size_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact. The user's own model is traced as long as it runs (8,191 positions without a position table) to
    catch a branch on a length; this step runs ops once a position (``stack``'s backward selects each piece),
    so its counts there are the probe's read at that length, and its trace is held to 2,053 positions: at
    8,191 it took 2.5 times as long as the whole derivation had before."""
    from symacct import pipeline

    lengths = []
    real = pipeline._trace
    monkeypatch.setattr(pipeline, "_trace", lambda *a, **k: lengths.append(a[4]) or real(*a, **k))
    torch.manual_seed(0)
    model = Positions(LoopConfig(width=18))
    acct = symacct.derive(model, optimizer="adamw")
    assert "L" in acct.symbols
    assert max(lengths) == pipeline.PER_POSITION_LONGEST == 2053
    exact_against_a_real_step(model, acct, points=((2, 7), (3, 11)))


@dataclasses.dataclass
class RNNConfig:
    vocab: int = 50
    width: int = 16
    n_layers: int = 2
    kind: str = "GRU"


class TorchRNN(nn.Module):
    """PyTorch's own nn.RNN or nn.GRU (the CPU kernels step through time, one small op group a step)."""

    def __init__(self, config: RNNConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.rnn = getattr(nn, config.kind)(config.width, config.width, num_layers=config.n_layers, batch_first=True)
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))  # (B, S, W)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


@pytest.mark.parametrize("kind", ["RNN", "GRU"])
def test_torch_recurrent_modules_are_refused_as_loops_over_the_sequence(kind: str) -> None:
    with pytest.raises(symacct.SymacctError) as e:
        symacct.derive(TorchRNN(RNNConfig(kind=kind)))
    assert "reads a dimension of S index by index" in e.value.what and e.value.module == "rnn"
    assert "nn.RNN and nn.GRU step through time" in str(e.value)
