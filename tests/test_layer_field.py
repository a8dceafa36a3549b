"""The layer count is found by structure, whatever the config calls it, and per-layer lists follow it.

Before: a field such as `depth` (T5's `num_layers`, `n_blocks`, ...) was probed as a size of its own, a
prime number of blocks was traced, and the model was refused as size-dependent control flow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import sympy
import torch
from torch import nn

import symacct
from symacct.measure.run import measure_step
from symacct.symbols import sym


@dataclasses.dataclass
class Cfg:
    width: int = 12
    depth: int = 3  # the layer count, under a name symacct has no alias for
    n_heads: int = 3  # equal to depth on purpose: only depth makes the blocks repeat
    kinds: tuple = ("relu", "relu", "relu")  # one entry per layer


class Net(nn.Module):
    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.config = c
        assert len(c.kinds) == c.depth
        self.blocks = nn.ModuleList(nn.Linear(c.width, c.width) for _ in range(c.depth))
        self.head = nn.Linear(c.width, c.n_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, kind in zip(self.blocks, self.config.kinds):
            x = block(x)  # (B, width)
            x = torch.relu(x) if kind == "relu" else torch.nn.functional.gelu(x)
        return self.head(x).sum()  # (B, n_heads) -> scalar

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.width),)


def test_layer_count_found_by_structure():
    acct = symacct.derive(Net(Cfg()))
    assert acct.fields["L"] == "depth" and acct.fields["H"] == "n_heads"
    assert any("depth counts the layers" in n for n in acct.notes)
    for depth in (2, 5):
        torch.manual_seed(0)
        model = Net(Cfg(depth=depth, kinds=("relu",) * depth))
        counted = measure_step(model, model.example_inputs(3, 1))
        at = acct.at(B=3, L=depth)
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes


def test_a_per_layer_list_that_differs_fixes_the_layer_count():
    """Layers of two kinds cannot be one repeated block: derived with L fixed (exact at this depth), said so."""
    cfg = Cfg(kinds=("relu", "gelu", "relu"))
    acct = symacct.derive(Net(cfg))
    assert "L" not in acct.free_symbols() and any("kinds differs between layers" in n for n in acct.notes)
    torch.manual_seed(0)
    model = Net(cfg)
    counted = measure_step(model, model.example_inputs(3, 1))
    assert acct.at(B=3).flops.total == counted.flops_total and acct.at(B=3).memory.activations == counted.saved_bytes


@pytest.mark.parametrize("name", ["n_layer", "depth"])
def test_a_known_name_and_a_found_one_give_the_same_formulas(name):
    class M(nn.Module):
        def __init__(self, c: object) -> None:
            super().__init__()
            self.config = c
            self.blocks = nn.ModuleList(nn.Linear(c.width, c.width) for _ in range(getattr(c, name)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x.sum()

        def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
            return (torch.randn(B, self.config.width),)

    C2 = dataclasses.make_dataclass("C2", [("width", int, 8), (name, int, 4)])
    acct = symacct.derive(M(C2()))
    B, L, W = sym("B"), sym("L"), sym("width")
    assert sympy.expand(acct.flops.total - (6 * B * L * W**2 - 2 * B * W**2)) == 0  # the first block skips dL/dx


@dataclasses.dataclass
class AttnCfg:
    width: int = 8
    n_layer: int = 2

    def __post_init__(self) -> None:
        self.attn_impl = "sdpa"  # the default; users set it after construction (as transformers' configs do)


class Attn(nn.Module):
    def __init__(self, c: AttnCfg) -> None:
        super().__init__()
        self.config = c
        self.blocks = nn.ModuleList(nn.Linear(c.width, c.width) for _ in range(c.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, width)
        for b in self.blocks:
            x = b(x)
            if self.config.attn_impl == "eager":  # an explicit softmax(x x^T) x: S^2 matmuls, saved probabilities
                x = torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x
            else:
                x = nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])[:, 0]
        return x.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_settings_set_after_construction_are_carried_to_the_probe_model():
    """The probe config is rebuilt with dataclasses.replace, which resets what __init__ sets: the eager
    model was traced as SDPA (another model, other figures, no word). Now the setting is carried over."""
    cfg = AttnCfg()
    cfg.attn_impl = "eager"
    acct = symacct.derive(Attn(cfg))
    for B, S in ((2, 5), (3, 11)):
        torch.manual_seed(0)
        model = Attn(cfg)
        counted = measure_step(model, model.example_inputs(B, S))  # eager: FlopCounterMode sees every matmul
        at = acct.at(B=B, S=S)
        assert at.flops.hardware == counted.flops_total and at.memory.activations == counted.saved_bytes


@dataclasses.dataclass
class IdsCfg:
    vocab_size: int = 50
    n_embd: int = 16
    head_dim: int = 4  # a size without a letter: it sets a weight's shape, so it is a symbol
    pad_token_id: int = 0  # ids and a chunk size: no tensor depends on them
    bos_token_id: int = 1
    chunk_size_feed_forward: int = 0


class WithIds(nn.Module):
    def __init__(self, c: IdsCfg) -> None:
        super().__init__()
        self.config = c
        self.emb = nn.Embedding(c.vocab_size, c.n_embd, padding_idx=c.pad_token_id)  # (V, D)
        self.q = nn.Linear(c.n_embd, c.head_dim)  # (D, head_dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.q(self.emb(idx)).sum()  # (B, S, head_dim) -> scalar

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab_size, (B, S)),)


def test_ids_and_flags_are_not_probed_as_sizes():
    """pad_token_id probed as a size became a padding index beyond the vocabulary and the model was refused;
    now the fields that set no tensor's shape keep the user's values (and say so)."""
    acct = symacct.derive(WithIds(IdsCfg()))
    assert set(acct.symbols) == {"V", "D", "head_dim"}
    assert any("pad_token_id" in n and "kept at their values" in n for n in acct.notes)
    for B, S in ((2, 3), (3, 7)):
        torch.manual_seed(0)
        model = WithIds(IdsCfg())
        counted = measure_step(model, model.example_inputs(B, S))
        at = acct.at(B=B, S=S)
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes


class HeadsOnly(nn.Module):
    """Attention whose head count sets no parameter's shape (its projections are D x D), only the heads' views
    and the (B, H, S, S) scores."""

    def __init__(self, D: int, H: int) -> None:
        super().__init__()
        self.heads = H
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, S, D/H)
        scores = (q @ k.transpose(-1, -2)).softmax(-1)  # (B, H, S, S)
        return self.out((scores @ v).transpose(1, 2).reshape(B, S, D)).sum()


def test_a_factory_dim_named_by_its_letter_is_a_size():
    """dims={"H": ...} names the head count by its letter, as n_head does in a config. It was taken for a field
    of no known name, tried for a parameter shape it changes, found none, and kept at its value with the note
    "H set no tensor size", which is false: the scores' bytes grow with it. Now it is a symbol, and the
    figures are exact at another head count."""
    acct = symacct.derive(lambda D, H: HeadsOnly(D, H), dims={"D": 16, "H": 2}, inputs=_width_inputs)
    assert "H" in acct.symbols and not [n for n in acct.notes if "set no tensor size" in n], acct.notes
    for D, H in ((16, 2), (24, 3)):
        torch.manual_seed(0)
        model = HeadsOnly(D, H)
        counted = measure_step(model, _width_inputs(model, 2, 5))
        at = acct.at(B=2, S=5, D=D, H=H)
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes


def _width_inputs(model: nn.Module, B: int, S: int) -> tuple[torch.Tensor]:
    """(B, S, width): the width read off the model's first Linear."""
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return (torch.randn(B, S, first.in_features),)


def _exact(acct: symacct.Accounting, make: Callable[[int], nn.Module], depths: tuple[int, ...]) -> None:
    """The derived FLOPs and saved bytes equal a real step's (``measure_step``) of ``make(depth)`` at (B, S) =
    (2, 3), for each depth (read at L = depth where L is a symbol, else the model's own)."""
    for depth in depths:
        torch.manual_seed(0)
        model = make(depth)
        counted = measure_step(model, _width_inputs(model, 2, 3))
        at = acct.at(B=2, S=3, **({"L": depth} if "L" in acct.fields.values() else {}))
        assert at.flops.total == counted.flops_total and at.memory.activations == counted.saved_bytes


class SequentialBlocks(nn.Module):
    """A stack of ``depth`` blocks, each a ``Sequential`` of four modules: as many as the probe's layer count."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
            )  # 4 modules: (B, S, width) -> (B, S, width)
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)  # (B, S, width)
        return self.head(x).sum()  # (B, S, 1) -> scalar


def test_a_blocks_sequential_of_as_many_modules_as_the_probes_layers_is_no_stack():
    """The probe traces 4 blocks, and each block here is a Sequential of 4 modules: the stack is the outer list,
    not each block's Sequential. Before, every block was taken as a stack of its own: the outer list was left
    unfactored with L fixed at its value, and ``at(L=...)`` refused."""

    acct = symacct.derive(lambda D, L: SequentialBlocks(D, L), dims={"D": 8, "L": 3}, inputs=_width_inputs)
    assert sym("L") in sympy.sympify(acct.flops.total).free_symbols
    assert any(n.startswith("blocks: layer stack factored") for n in acct.notes), acct.notes
    _exact(acct, lambda depth: SequentialBlocks(8, depth), (2, 4, 6))


class StemAndBlocks(nn.Module):
    """A stem of four Linear layers, always four, before a stack of ``depth`` blocks."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))  # (B, S, width), 4 at any depth
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))  # (B, S, width)
        return self.head(x).sum()


def test_a_list_of_four_modules_beside_the_stack_is_no_stack():
    """The stem holds 4 Linear layers at any depth, as many as the probe's blocks: only the list that holds one
    more at one layer more is the stack. Before, the stem was taken as a stack of L blocks too, and the model was
    refused as one whose stack "has 4 blocks where its config's L = 3 builds 3"."""

    acct = symacct.derive(lambda D, L: StemAndBlocks(D, L), dims={"D": 8, "L": 3}, inputs=_width_inputs)
    assert [n for n in acct.notes if "factored" in n] == [
        "blocks: layer stack factored as blocks.0 + (L - 1) * blocks.1"
    ]
    _exact(acct, lambda depth: StemAndBlocks(8, depth), (2, 6))


class SharedBlock(nn.Module):
    """One block of four modules applied ``depth`` times (the layers share it)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.block = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = x + self.block(x)  # (B, S, width)
        return self.head(x).sum()


def test_a_block_of_four_modules_applied_l_times_is_said_to_share_its_modules():
    """The block's Sequential holds 4 modules at any depth: no list of L blocks holds the layers, and the note
    says so (before, it read "the blocks of the layer stack differ", of the four modules of one block). L is
    fixed at its value, and the figures are exact there."""

    acct = symacct.derive(lambda D, L: SharedBlock(D, L), dims={"D": 8, "L": 3}, inputs=_width_inputs)
    assert acct.notes[0].startswith("the ops change with L but no nn.ModuleList of L blocks holds them"), acct.notes
    _exact(acct, lambda depth: SharedBlock(8, depth), (3,))


class LikeLayersLoop(nn.Module):
    """A ``Sequential`` of four identical Linear layers, applied ``depth`` times; with ``stem``, the four are a
    stem run once and the loop runs one shared Linear. No list holds ``depth`` modules."""

    def __init__(self, width: int, depth: int, stem: bool = False) -> None:
        super().__init__()
        self.depth, self.stem = depth, stem
        self.four = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))  # (B, S, width) -> (B, S, width)
        self.shared = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stem:
            x = self.four(x)
        for _ in range(self.depth):
            x = x + torch.tanh((self.shared if self.stem else self.four)(x))  # (B, S, width)
        return self.head(x).sum()


@pytest.mark.parametrize("stem", [False, True], ids=["applied-l-times", "stem"])
@pytest.mark.parametrize("depth", [3, 4])
def test_four_like_layers_the_model_holds_at_every_l_are_no_stack(stem, depth):
    """Four identical layers factor as a stack of the probe's four blocks, but the model holds four at every L.
    At L = 3 the user's model then held "4 blocks where its config's L = 3 builds 3" and was refused with that;
    at L = 4 the formulas missed the checking trace, refused as "the op sequence changes with the sizes". Now
    either failure builds the model with one layer more, finds the four do not follow L, and derives with L
    fixed, with a note that names the list; the figures are exact at that L."""
    acct = symacct.derive(lambda D, L: LikeLayersLoop(D, L, stem), dims={"D": 8, "L": depth}, inputs=_width_inputs)
    assert acct.notes[0].startswith("four holds 4 modules at every L"), acct.notes
    assert "L" not in {str(s) for s in acct.flops.total.free_symbols}
    _exact(acct, lambda d: LikeLayersLoop(8, d, stem), (depth,))


class Zipped(nn.Module):
    """Two stacks of ``depth`` blocks zipped in one loop, the residual adds in the model's own forward."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.attns = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.mlps = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, mlp, norm in zip(self.attns, self.mlps, self.norms):
            x = x + attn(norm(x))  # (B, S, width): an add of the root module between two stacks' blocks
            x = x + torch.nn.functional.gelu(mlp(x))
        return self.head(x).sum()


class OneAfterTheOther(Zipped):
    """The same stacks run one after the other, with an op of the root module between them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, norm in zip(self.attns, self.norms):
            x = x + attn(norm(x))  # (B, S, width)
        x = x * 2.0  # between the first stack's last block and the second's first: in neither
        for mlp in self.mlps:
            x = x + torch.nn.functional.gelu(mlp(x))
        return self.head(x).sum()


@pytest.mark.parametrize("cls", [Zipped, OneAfterTheOther])
def test_stacks_zipped_in_one_loop_or_run_one_after_the_other_are_factored(cls):
    """Before, the adds between block i of one zipped stack and block i of the next belonged to no block: the
    model was refused as not the model given at L = 2 or 3 ("aten.add.Tensor runs 4 times in the given model
    and 8 times in the rebuilt one") and as size-dependent control flow at L = 6. Stacks run one after the
    other must stay as they were: an op between them belongs to neither, also where the model given has one
    or two blocks (its trace cannot tell zipped stacks from these: the probe's tells)."""

    for given in (1, 2, 6):
        acct = symacct.derive(lambda D, L: cls(D, L), dims={"D": 8, "L": given}, inputs=_width_inputs)
        assert sym("L") in sympy.sympify(acct.flops.total).free_symbols
        _exact(acct, lambda depth: cls(8, depth), (1, 2, 5))


class ExpertsPerLayer(nn.Module):
    """A gate and ``n_experts`` experts in each of ``depth`` layers; an auxiliary sum that starts from 0 in the
    first layer (an add of a Python number there), so the blocks differ and L is fixed."""

    def __init__(self, width: int, n_experts: int, depth: int) -> None:
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(width, n_experts) for _ in range(depth))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Linear(width, width) for _ in range(n_experts)) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux: Any = 0
        for gate, experts in zip(self.gates, self.experts):
            w = gate(x).softmax(-1)  # (B, S, n_experts)
            x = x + sum(w[..., i : i + 1] * e(x) for i, e in enumerate(experts))  # (B, S, width)
            aux = aux + (w.mean((0, 1)) ** 2).sum()
        return x.sum() + aux


def test_with_the_layer_count_fixed_no_other_count_is_taken_for_it():
    """Once L is fixed (the blocks differ), derive ran again and looked for a layer count among the other
    fields: the experts' count, whose lists grow with it, was taken for L and fixed too, and the note said
    so twice. Now it says once that L is fixed."""

    acct = symacct.derive(lambda D, E, L: ExpertsPerLayer(D, E, L), dims={"D": 8, "E": 3, "L": 2}, inputs=_width_inputs)
    fixed = [n for n in acct.notes if "L fixed at its value" in n]
    assert fixed == ["the blocks of the layer stack differ: the layer stack is left unfactored, L fixed at its value"]
    assert "L" not in acct.fields.values() and not any("counts the layers" in n for n in acct.notes)
    _exact(acct, lambda depth: ExpertsPerLayer(8, 3, depth), (2,))


class Squared(nn.Module):
    """``depth`` blocks of ``depth`` Linear layers each: a list of L inside each block of the stack."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(width, width) for _ in range(depth)) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            for layer in block:
                x = torch.relu(layer(x))  # (B, S, width)
        return self.head(x).sum()


def test_a_list_of_l_inside_each_block_of_the_stack_is_refused():
    """The outer list is the stack; the inner one, L long too, is one of each block's parts, which the model
    given holds another number of than the probe's blocks: refused (before: a crash inside symacct, "ModuleList
    has no attribute `3`")."""
    with pytest.raises(symacct.SymacctError, match="not the model given"):
        symacct.derive(
            lambda D, L: Squared(D, L),
            dims={"D": 8, "L": 3},
            inputs=_width_inputs,
        )
