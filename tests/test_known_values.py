"""symacct.trace.known: the values a fake tensor holds because of how the step made it, and the value reads
they answer. Each rule against the same ops on real tensors, and what stays unknown (a read of it is still
refused)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import symacct
from symacct.cost.graph import records
from symacct.errors import SymacctError
from symacct.trace.known import ONES, known, propagate, read, recipe

aten = torch.ops.aten


class _Known(torch.utils._python_dispatch.TorchDispatchMode):
    """The propagation rules alone, on real tensors (where every answer can be checked)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        answered, value = read(func, args)
        out = func(*args, **kwargs)
        if answered:
            assert value == out and type(value) is type(out)  # the answer given without values is the value
        propagate(func, args, kwargs, out)
        return out


def test_made_ones_and_what_keeps_them() -> None:
    with _Known():
        ones = torch.ones(3, 4)
        full = torch.full((2, 3), 1, dtype=torch.bool)
        views = [ones[:, 1:], ones.t(), ones.view(12), ones.unsqueeze(0).expand(2, 3, 4), ones[torch.tensor([0, 2])]]
        copies = [ones.to(torch.bool), ones.clone(), torch.cat([ones, ones])]
        assert all(known(t) is ONES for t in [ones, full, *views, *copies])
        assert known(torch.zeros(3)) is None and known(torch.full((2,), 2.0)) is None
        assert known(ones.all()) is True and known(ones.sum()) == 12
        fast_all = ones.sum() == ones.numel()  # transformers' fast_all
        assert known(fast_all) is True and bool(fast_all)
        assert known(ones + ones) is None  # no rule: unknown
        total = ones.sum()
        assert total.item() == 12.0 and isinstance(total.item(), float)  # read by the rule, checked by _Known


def test_a_write_forgets_the_value() -> None:
    with _Known():
        ones = torch.ones(4)
        view = ones[1:]
        view.mul_(0)  # written through a view: the base's version moves too
        assert known(ones) is None and known(view) is None
        assert known(ones.fill_(1)) is None  # an in-place op makes nothing known


class _Reads(nn.Module):
    """A step that reads a value: whether its own all-ones mask holds padding (known), or whether its input
    is positive (unknown)."""

    def __init__(self, known_mask: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.known_mask = known_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 4)
        mask = torch.ones(x.shape[0], dtype=torch.bool) if self.known_mask else x[:, 0] > 0
        y = self.lin(x)
        return y * 2 if bool(mask.all()) else y


def test_a_known_read_is_answered_and_an_unknown_one_refused() -> None:
    def inputs(model: nn.Module, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, 4),)

    acct = symacct.derive(_Reads(True), inputs=inputs, step="forward")
    ops = [node.op for _, node in records(acct.graph)]
    assert "aten.mul.Tensor" in ops  # the branch an eager run takes: no padding in a mask of ones
    with pytest.raises(SymacctError, match="depends on tensor values"):
        symacct.derive(_Reads(False), inputs=inputs, step="forward")


def test_tensors_of_one_recipe_are_equal() -> None:
    """PyTorch's nn.TransformerEncoder compares a mask it is given with the causal mask it builds, element by
    element (``_detect_is_causal_mask``): the same recipe (factory, constants, the ops after) is equal."""
    from torch.nn.modules.transformer import _generate_square_subsequent_mask

    with _Known():
        mask = nn.Transformer.generate_square_subsequent_mask(5)  # dtype and device by default
        built = _generate_square_subsequent_mask(5, device=mask.device, dtype=mask.dtype)  # named
        assert recipe(mask) is not None and recipe(mask) == recipe(built)
        same = mask == built
        assert known(same) is ONES and bool(same.all())  # the read answered, and checked against the values
        assert torch.equal(mask, built)  # answered as well (True, a bool)
        other = torch.full((5, 5), float("-inf")).triu(2)
        assert known(mask == other) is None  # another recipe: unknown
        assert recipe(torch.full((2,), float("nan"))) is None  # NaN != NaN: no recipe
        inf = torch.full((2,), float("inf"))
        assert recipe(inf - inf) is None  # arithmetic (inf - inf is NaN) keeps none
        bools = torch.ones(5, 5, dtype=torch.bool).triu(1)
        assert known(bools == bools.clone()) is ONES
        bools.logical_not_()  # a write forgets the recipe
        assert recipe(bools) is None
