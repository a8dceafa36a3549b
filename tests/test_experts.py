"""Mixtures of experts: derived totals hold for any routing; the split over the experts follows ``routing=``.

The routed work is B*S*k (token, expert) pairs through grouped matmuls
whatever the routing (symacct.cost.experts). Checked on real CPU steps of a
Qwen2-MoE model (routed experts plus a gated shared expert) under several
random routings and one that sends every token to the same k experts:
matmul FLOPs (FlopCounterMode plus the grouped matmuls counted group by group
from their real offsets by ``measure.GroupedMmCounter``), saved bytes
(saved_tensors_hooks), parameters, and the peak (storage tracker) all equal
derive's figures, unchanged; each expert's FLOPs equal derive's split under
the routing that ran. Also: a mixture written by hand with
``torch._grouped_mm`` (no transformers code), gpt-oss's experts (transposed
weights with biases), and the refusals (an experts path whose shapes follow
the routing, a width the CPU kernel refuses, a routing= that does not fit).
Mixtral, eager and SDPA, is a family of test_transformers.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import symacct
from symacct import SymacctError
from symacct.measure.run import GroupedMmCounter, measure_memory, measure_step
from symacct.models.hf import task


@dataclass
class MoEConfig:
    vocab_size: int = 40
    dim: int = 16
    hidden_dim: int = 24  # each expert's width (F)
    num_experts: int = 5
    num_experts_per_tok: int = 2


class TinyMoE(nn.Module):
    """A mixture of experts written by hand, as transformers' grouped_mm path does it: the (token, expert)
    pairs sorted by expert, two grouped matmuls, the pairs put back and weighted."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.router = nn.Linear(c.dim, c.num_experts, bias=False)
        self.up = nn.Parameter(torch.randn(c.num_experts, c.dim, c.hidden_dim) / c.dim**0.5)
        self.down = nn.Parameter(torch.randn(c.num_experts, c.hidden_dim, c.dim) / c.hidden_dim**0.5)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        k, E = self.config.num_experts_per_tok, self.config.num_experts
        x = self.embed(ids)  # (B, S, D)
        B, S, D = x.shape
        h = x.reshape(B * S, D)  # (T, D)
        weight, chosen = self.router(h).softmax(-1).topk(k)  # (T, k)
        experts, order = chosen.reshape(-1).sort()  # (T*k,): the pairs by expert
        offsets = torch.cumsum(torch.histc(experts.float(), bins=E, min=0, max=E - 1), 0).int()  # (E,)
        y = torch._grouped_mm(h[order // k], self.up, offs=offsets)  # (T*k, F)
        y = torch._grouped_mm(F.gelu(y), self.down, offs=offsets)  # (T*k, D)
        back = torch.empty_like(y)
        back[order] = y  # the pairs in token order
        out = (back.view(B * S, k, D) * weight.unsqueeze(-1)).sum(1)  # (T, D)
        return F.cross_entropy(self.head(out), ids.reshape(-1))

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab_size, (B, S)),)


def test_a_hand_written_mixture_is_exact_and_its_routing_checked() -> None:
    torch.manual_seed(0)
    model = TinyMoE(MoEConfig())
    acct = symacct.derive(model)
    assert {"E", "k", "F"} <= set(acct.free_symbols()) and str(acct.experts[0].pairs) == "B*S*k"
    for B, S in ((2, 7), (3, 11)):
        counted = measure_step(model, model.example_inputs(B, S))
        model.zero_grad(set_to_none=True)
        at = acct.at(B=B, S=S)
        assert at.flops.forward == counted.flops_forward + counted.grouped_forward
        assert at.flops.backward == counted.flops_backward + counted.grouped_backward
        assert at.memory.activations == counted.saved_bytes
    with pytest.raises(SymacctError, match="routing= gives 2 shares, but <root> has 5 experts"):
        symacct.derive(model, routing=[1, 2])


transformers = pytest.importorskip("transformers")
T = transformers

ROUTINGS = min(settings.default.max_examples, 3)  # random routings of one derived model in CI


def qwen2_moe(experts: int = 6, top_k: int = 2, **extra: Any) -> Any:
    fields = dict(
        hidden_size=32, intermediate_size=24, moe_intermediate_size=16, shared_expert_intermediate_size=20,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
        max_position_embeddings=32, num_experts=experts, num_experts_per_tok=top_k, attn_implementation="sdpa",
    )  # fmt: skip
    config = T.Qwen2MoeConfig(**{**fields, **extra})
    torch.manual_seed(0)
    return T.Qwen2MoeForCausalLM(config)


def _routers(model: Any) -> list[torch.Tensor]:
    return [layer.mlp.gate.weight for layer in model.model.layers]


@pytest.fixture(scope="module")
def derived() -> tuple[Any, Any]:
    model = qwen2_moe()
    return model, symacct.derive(model, optimizer="adamw")


def _check_totals(model: Any, acct: Any, B: int, S: int) -> None:
    step = task(model)
    args = step.inputs(model, B, S)
    counted = measure_step(model, args, loss=step.loss)
    model.zero_grad(set_to_none=True)
    at = acct.at(B=B, S=S)
    assert counted.grouped_forward > 0
    assert at.flops.forward == counted.flops_forward + counted.flash_forward + counted.grouped_forward
    assert at.flops.backward + at.flops.recompute == (
        counted.flops_backward + counted.flash_backward + counted.grouped_backward
    )
    assert at.memory.activations == counted.saved_bytes
    assert at.params == sum(p.numel() for p in model.parameters())
    real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), loss=step.loss)
    model.zero_grad(set_to_none=True)
    assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)


def test_the_formulas_name_experts_and_experts_per_token(derived: tuple[Any, Any]) -> None:
    _, acct = derived
    assert {"E", "k", "moe_intermediate_size", "shared_expert_intermediate_size"} <= set(acct.free_symbols())
    assert acct.fields["E"] == "num_experts" and acct.fields["k"] == "num_experts_per_tok"
    (layers,) = acct.experts
    assert layers.module == "model.layers.*.mlp.experts" and str(layers.pairs) == "B*S*k"
    assert any("mixture of experts" in n and "balanced" in n for n in acct.notes)


def test_totals_are_the_same_for_any_routing(derived: tuple[Any, Any]) -> None:
    model, acct = derived
    saved = [w.detach().clone() for w in _routers(model)]

    @settings(max_examples=ROUTINGS, phases=[Phase.explicit, Phase.generate], deadline=None)
    @given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 30.0]), B=st.integers(2, 3))
    def run(seed: int, scale: float, B: int) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for w in _routers(model):
                w.normal_(0, scale)  # 30: nearly one-hot router probabilities, very uneven loads
        _check_totals(model, acct, B, 11)

    try:
        run()
        with torch.no_grad():  # every token to the same k experts: the others get no rows at all
            for w in _routers(model):
                w.zero_()
        _check_totals(model, acct, 2, 9)
    finally:
        with torch.no_grad():
            for w, s in zip(_routers(model), saved):
                w.copy_(s)


def test_the_split_over_the_experts_follows_the_routing_that_ran(derived: tuple[Any, Any]) -> None:
    """A zero router sends every token to the same k experts (top-k of equal scores); derive given that routing
    predicts each expert's FLOPs, forward and backward, every layer, exactly as the kernel ran them."""
    model = qwen2_moe()
    with torch.no_grad():
        for w in _routers(model):
            w.zero_()
    step = task(model)
    B, S = 2, 9
    args = step.inputs(model, B, S)
    counter = GroupedMmCounter()
    with counter:
        step.loss(model(**args)).backward()
    model.zero_grad(set_to_none=True)
    routed = counter.rows[0]  # the first layer's (token, expert) pairs per expert; every layer routes alike
    assert all(rows == routed for rows in counter.rows) and sorted(routed)[-2:] == [B * S, B * S]
    acct = symacct.derive(model, routing=routed)
    split = acct.experts[0].per_expert(B=B, S=S)
    assert [s.flops for s in split] == counter.per_group
    assert [s.pairs for s in split] == routed
    balanced = derived[1].experts[0].per_expert(B=B, S=S)  # the same config, derived without routing=
    assert sum(s.flops for s in balanced) == sum(counter.per_group)  # the same total, evenly split
    assert len({s.flops for s in balanced}) == 1


def test_routing_is_checked() -> None:
    model = qwen2_moe(experts=4)
    with pytest.raises(SymacctError, match="routing= gives 3 shares, but model.layers.0.mlp.experts has 4"):
        symacct.derive(model, routing=[1, 1, 2])
    with pytest.raises(SymacctError, match="non-negative"):
        symacct.derive(model, routing=[1, -1, 1, 1])
    dense = T.LlamaForCausalLM(
        T.LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=30, max_position_embeddings=32)
    )  # fmt: skip
    with pytest.raises(SymacctError, match="no expert layers"):
        symacct.derive(dense, routing=[1, 1])


@pytest.mark.parametrize("path", ["eager", "batched_mm"])
def test_an_experts_path_with_routed_shapes_is_refused(path: str) -> None:
    model = qwen2_moe(experts_implementation=path)
    with pytest.raises(SymacctError, match=f"experts path '{path}'") as e:
        symacct.derive(model)
    assert "model.layers.0.mlp.experts" in str(e.value) and "experts_implementation='grouped_mm'" in str(e.value)


def test_an_expert_width_the_cpu_kernel_refuses_is_refused() -> None:
    """An expert width of 10 float32 (40-byte rows): the CPU grouped-matmul kernel raises on the real model,
    and derive refuses on the user's own widths instead of deriving probe widths that do run."""
    model = qwen2_moe(moe_intermediate_size=10)
    step = task(model)
    with pytest.raises(RuntimeError, match="16 bytes"):
        step.loss(model(**step.inputs(model, 2, 5))).backward()
    with pytest.raises(SymacctError, match="16 bytes"):
        symacct.derive(model)


def test_verify_has_a_grouped_matmul_row(derived: tuple[Any, Any]) -> None:
    from symacct.measure.verify import verify

    model, acct = derived
    rows = verify(model, acct, B=2, S=7, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    grouped = [r for r in rows if r.name.startswith("grouped-matmul FLOPs")]
    assert len(grouped) == 1 and grouped[0].measured > 0
    assert all(r.ok for r in rows if r.tolerance is not None), [r for r in rows if not r.ok]


def test_gpt_oss_experts_with_biases_are_exact() -> None:
    """gpt-oss's experts: weights stored transposed, a bias on each grouped matmul, its own gate; sliding and
    full attention layers alternate (layer_types), so the stack is left unfactored and L kept."""
    if not hasattr(T, "GptOssForCausalLM"):
        pytest.skip("this transformers has no gpt-oss")
    config = T.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=50, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(config)
    acct = symacct.derive(model, optimizer="adamw")
    assert {"E", "k", "F"} <= set(acct.free_symbols())
    _check_totals(model, acct, 2, 9)
