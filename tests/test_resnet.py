"""The ResNet reference model (strided convolutions, max pooling, batch norm, global pooling, a classifier)
is exact against the counters: matmul FLOPs (convolutions) against FlopCounterMode, saved bytes against
saved_tensors_hooks, parameters, and the memory phases and peak against a real step with AdamW.

The image side S is halved five times: the formulas hold where 32 divides S, which derive learns from
the trace (the sizes S/32 it reads) and enforces."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import symacct
from symacct import SymacctError
from symacct.measure.run import measure_memory, measure_step
from symacct.models import ResNet, ResNetConfig
from symacct.symbols import sym


@settings(max_examples=min(settings.default.max_examples, 3), phases=[Phase.explicit, Phase.generate])
@given(
    width=st.integers(2, 6),
    classes=st.integers(2, 12),
    channels=st.integers(2, 3),
    blocks=st.sampled_from([(1, 1, 1, 1), (2, 2, 2, 2), (1, 2, 1, 1)]),
    batch=st.integers(2, 3),
    sides=st.sampled_from([(32, 64), (64, 96)]),
)
def test_resnet_is_exact(width, classes, channels, blocks, batch, sides):
    torch.manual_seed(0)
    model = ResNet(ResNetConfig(width=width, num_classes=classes, blocks=blocks, channels=channels))
    acct = symacct.derive(model, optimizer="adamw")
    for B, S in ((batch, sides[0]), (batch + 1, sides[1])):
        args = model.example_inputs(B, S)
        at = acct.at(B=B, S=S)
        counted = measure_step(model, args)
        model.zero_grad(set_to_none=True)
        assert (at.flops.forward, at.flops.backward) == (counted.flops_forward, counted.flops_backward)
        assert at.memory.activations == counted.saved_bytes
        assert at.params == sum(p.numel() for p in model.parameters())
        real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        assert (at.memory.after_forward, at.memory.after_backward, at.memory.peak) == (
            real.after_forward,
            real.after_backward,
            real.peak,
        )
        model.zero_grad(set_to_none=True)


def test_resnet_formulas_are_in_the_image_side_and_refuse_other_sides():
    acct = symacct.derive(ResNet(ResNetConfig(width=4, num_classes=10)))
    S, width = sym("S"), sym("width")
    assert S in acct.flops.total.free_symbols and width in acct.flops.total.free_symbols
    assert acct.flops.forward.as_poly(S).degree() == 2  # convolutions over S x S pixels
    acct.at(B=2, S=224)  # 32 * 7
    with pytest.raises(SymacctError, match="32 divides S|divides S"):
        acct.at(B=2, S=200)
