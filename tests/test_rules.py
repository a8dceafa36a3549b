"""Unit tests per rule, with the arithmetic spelled out. Distinct primes for dimensions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from symacct.cost.graph import cost_ops
from symacct.trace.record import record_step

aten = torch.ops.aten


def costs_of(fn, *shapes, dtype=torch.float32, requires_grad=False):
    """Record ``fn`` on fake tensors of ``shapes`` (forward only) and cost every op with integer shapes."""

    class M(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    tr = record_step(
        lambda fake: M(),
        lambda m: tuple(torch.ones(s, dtype=dtype, requires_grad=requires_grad) for s in shapes),
        step="forward",
    )
    return [(str(c.rec.op), c.cost) for c in cost_ops(tr, lambda v: v)]


def only(costs, name):
    got = [c for op, c in costs if op.startswith(name)]
    assert len(got) == 1, costs
    return got[0]


def test_mm_is_2mkn():
    c = only(costs_of(lambda a, b: a @ b, (3, 5), (5, 7)), "aten.mm")
    assert c.flops == 2 * 3 * 5 * 7  # 2*M*K*N
    assert c.flops_other == 0
    assert c.bytes_read == (3 * 5 + 5 * 7) * 4  # both operands, fp32
    assert c.bytes_written == 3 * 7 * 4


def test_bmm_is_2bmkn():
    c = only(costs_of(lambda a, b: a @ b, (2, 3, 5), (2, 5, 7)), "aten.bmm")
    assert c.flops == 2 * 2 * 3 * 5 * 7  # 2*B*M*K*N


def test_addmm_bias_not_counted():
    c = only(costs_of(lambda x, w, b: torch.addmm(b, x, w), (3, 5), (5, 7), (7,)), "aten.addmm")
    assert c.flops == 2 * 3 * 5 * 7


def test_pointwise_one_flop_per_element():
    c = only(costs_of(lambda a, b: a + b, (3, 5), (3, 5)), "aten.add")
    assert c.flops == 0 and c.flops_other == 3 * 5
    assert c.bytes_read == 2 * 3 * 5 * 4 and c.bytes_written == 3 * 5 * 4


def test_scatter_add_one_add_per_source_element():
    """Phi-MoE's router scatters its top-k weights into (tokens, E) with scatter_add: one add per element of
    src (7 x 2 here), not per element of the (7, 5) result."""

    def scatter(a, src):
        return a.scatter_add(1, torch.zeros(7, 2, dtype=torch.long), src)

    c = only(costs_of(scatter, (7, 5), (7, 2)), "aten.scatter_add")
    assert c.flops == 0 and c.flops_other == 7 * 2
    fill = only(costs_of(lambda a: a.clone().exponential_(), (3, 5)), "aten.exponential_")  # a random fill
    assert fill.flops_other == 0 and fill.bytes_read == 0 and fill.bytes_written == 3 * 5 * 4


def test_broadcast_reads_each_operand_once():
    c = only(costs_of(lambda a, b: a * b, (3, 5), (5,)), "aten.mul")
    assert c.bytes_read == (3 * 5 + 5) * 4
    assert c.flops_other == 3 * 5


def test_gelu_counts_its_definition():
    c = only(costs_of(torch.nn.functional.gelu, (3, 7)), "aten.gelu")
    assert c.flops_other == 5 * 3 * 7  # x * 0.5 * (1 + erf(x / sqrt 2)): 5 per element


def test_views_move_nothing_copies_move_bytes():
    costs = costs_of(lambda a: a.t().contiguous(), (3, 5))
    t = only(costs, "aten.t")
    assert (t.bytes_read, t.bytes_written, t.flops_other) == (0, 0, 0)
    clone = only(costs, "aten.clone")
    assert (clone.bytes_read, clone.bytes_written, clone.flops_other) == (3 * 5 * 4, 3 * 5 * 4, 0)


def test_reduction_one_flop_per_input_element():
    c = only(costs_of(lambda a: a.sum(-1), (3, 5, 7)), "aten.sum")
    assert c.flops_other == 3 * 5 * 7
    assert c.bytes_written == 3 * 5 * 4


def test_softmax_five_per_element():
    c = only(costs_of(lambda a: torch.softmax(a, -1), (3, 5)), "aten._softmax")
    assert c.flops_other == 5 * 3 * 5  # max, sub, exp, sum, div


def test_embedding_reads_only_gathered_rows():
    def f(idx, w):
        return torch.nn.functional.embedding(idx.long(), w)

    c = only(costs_of(f, (3, 5), (11, 7)), "aten.embedding")
    # indices after .long() (3*5 int64) + the 3*5 rows of 7 floats, not the 11x7 table
    assert c.bytes_read == 3 * 5 * 8 + 3 * 5 * 7 * 4
    assert c.flops == 0


def test_layer_norm_seven_per_element():
    c = only(costs_of(lambda a: torch.nn.functional.layer_norm(a, (5,)), (3, 5)), "aten.native_layer_norm")
    assert c.flops_other == 7 * 3 * 5


def test_sdpa_cpu_kernel_counted_like_flop_counter_formula():
    q = (2, 3, 5, 7)  # b, h, s, d
    c = only(
        costs_of(lambda a, b, v: torch.nn.functional.scaled_dot_product_attention(a, b, v), q, q, q),
        "aten._scaled_dot_product_flash_attention_for_cpu",
    )
    assert c.flops == 2 * (2 * 2 * 3 * 5 * 5 * 7)  # QK^T and PV: 2 x 2*b*h*s*s*d


def test_registered_ops_are_real_ops_and_duplicates_raise():
    from symacct.cost.rules import rule
    from symacct.cost.rules.registry import _BY_OP

    # every registration names an op that exists in this torch (aten's, or the functional collectives'),
    # with overloads to dispatch to
    for packet in _BY_OP:
        namespace = getattr(torch.ops, packet._qualified_op_name.split("::")[0])
        assert getattr(namespace, packet.__name__) is packet and packet.overloads(), packet
    with pytest.raises(RuntimeError, match="duplicate"):
        rule(aten.mm)(lambda call: None)
    with pytest.raises(TypeError, match="op packet"):
        rule(aten.mm.default)(lambda call: None)  # an overload, not a packet: refused


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (torch.mm, [(3, 5), (5, 7)]),
        (lambda b, a, c: torch.addmm(b, a, c), [(7,), (3, 5), (5, 7)]),
        (torch.bmm, [(2, 3, 5), (2, 5, 7)]),
        (lambda b, a, c: torch.baddbmm(b, a, c), [(2, 3, 7), (2, 3, 5), (2, 5, 7)]),
        (lambda x, w: torch.nn.functional.conv1d(x, w), [(2, 3, 11), (5, 3, 3)]),
        (lambda x, w: torch.nn.functional.conv2d(x, w, stride=2), [(2, 3, 9, 11), (5, 3, 3, 3)]),
    ],
)
def test_matmul_rules_equal_flop_counter_on_real_tensors(fn, shapes):
    """The matmul family's rule against FlopCounterMode on real tensors, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    class M(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs).sum()

    xs = [torch.randn(*s, requires_grad=True) for s in shapes]
    with FlopCounterMode(display=False) as fc:
        M()(*xs).backward()
    tr = record_step(lambda fake: M(), lambda m: tuple(torch.ones(s, requires_grad=True) for s in shapes))
    ours = sum(c.cost.flops + c.cost.flops_recompute for c in cost_ops(tr, lambda v: v))
    assert ours == fc.get_total_flops() > 0


def test_conventions_doc_lists_every_table_entry():
    """docs/conventions.md prints the per-element tables; it must not go stale."""
    from pathlib import Path

    from symacct.cost.rules.pointwise import COMPLEX_PER_ELEMENT, PER_ELEMENT
    from symacct.cost.rules.reductions import FUSED, LOSSES, TAPS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "conventions.md").read_text()
    for table in (PER_ELEMENT, COMPLEX_PER_ELEMENT, FUSED, LOSSES, TAPS):
        for op, k in table.items():
            assert f"| `{op}` | {k} |" in doc, f"docs/conventions.md is stale for {op}"


def test_cost_adds_and_scales_field_by_field():
    import sympy

    from symacct.cost.rules import Cost
    from symacct.symbols import sym

    B, L = sym("B"), sym("L")
    a = Cost(flops=2 * B, flops_other=3, bytes_read=4, bytes_written=5, flops_recompute=1)
    b = Cost(flops=B, bytes_read=1, bytes_written=0)
    assert a + b == Cost(flops=3 * B, flops_other=3, bytes_read=5, bytes_written=5, flops_recompute=1)
    assert a * L == L * a == Cost(flops=2 * B * L, flops_other=3 * L, bytes_read=4 * L, bytes_written=5 * L,
                                  flops_recompute=L)  # fmt: skip
    total = Cost.total([a * L, b, b])
    assert sympy.expand(total.flops - (2 * B * L + 2 * B)) == 0 and total.bytes_read == 4 * L + 2
    with pytest.raises(ValueError, match="default"):
        a + Cost(flops=1)  # bytes left to the default are not 0: they must be filled first


def test_graph_records_are_frozen_and_left_alone_downstream():
    """Nothing downstream changes a node: the roofline's per-node times come back beside the graph."""
    import dataclasses

    import symacct
    from symacct.cost.graph import records
    from symacct.models import Cruncher, CruncherConfig
    from symacct.time.model import roofline

    acct = symacct.derive(Cruncher(CruncherConfig(dim=16, n_layers=2)))
    before = dict(records(acct.graph))
    node = next(iter(before.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.count = 2
    roof = roofline(acct, "H100-SXM", B=4)
    acct.at(B=4)
    assert dict(records(acct.graph)) == before
    assert set(roof.by_node) == {n for n, a in before.items() if a.phase != "input"}


class _Activated(torch.nn.Module):
    """L blocks of Linear -> an activation: (B, width) -> (B, width)."""

    def __init__(self, act: type[torch.nn.Module], width: int, L: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), act()) for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, width)
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


# activation -> its ops without PyTorch's pointwise tag, each with its FLOPs per written element counted
# by hand from its definition (the second output of PReLU's backward is the weight's elementwise gradient)
_UNTAGGED = {
    torch.nn.Softplus: {"softplus_backward": 5},
    torch.nn.ELU: {"elu_backward": 3},
    torch.nn.LeakyReLU: {"leaky_relu_backward": 2},
    torch.nn.Hardtanh: {"hardtanh_backward": 1},
    torch.nn.Hardsigmoid: {"hardsigmoid_backward": 2},
    torch.nn.Hardswish: {"hardswish": 4, "hardswish_backward": 3},
    torch.nn.Mish: {"mish_backward": 9},
    torch.nn.Softshrink: {"softshrink_backward": 1},
    torch.nn.Hardshrink: {"hardshrink_backward": 1},
    torch.nn.PReLU: {"_prelu_kernel": 2, "_prelu_kernel_backward": 2 * 2},
    torch.nn.RReLU: {"rrelu_with_noise": 3, "rrelu_with_noise_backward": 2},
}


@pytest.mark.parametrize("act", list(_UNTAGGED), ids=lambda a: a.__name__)
def test_activations_without_the_pointwise_tag_are_costed(act: type[torch.nn.Module]) -> None:
    """Activations whose kernels PyTorch does not tag pointwise derive (no refusal) and cost their
    definition's arithmetic on each of the L * B * width elements they write."""
    import sympy

    import symacct
    from symacct.cost.graph import records
    from symacct.symbols import sym

    acct = symacct.derive(
        lambda width, L: _Activated(act, width, L),
        dims={"width": 16, "L": 2},
        inputs=lambda model, B, S: (torch.randn(B, model.inp.in_features),),
        loss=lambda out: out.sum(),
    )
    B, width, L = sym("B"), sym("width"), sym("L")
    for name, k in _UNTAGGED[act].items():
        total = sum(
            (n.cost.flops_other * n.count for _, n in records(acct.graph) if n.op.startswith(f"aten.{name}.")),
            sympy.Integer(0),
        )
        assert sympy.expand(total - k * L * B * width) == 0, (name, total)


@dataclasses.dataclass
class _RotaryConfig:
    width: int = 16  # even: pairs of it are complex numbers
    max_len: int = 32  # S_max: the rotation table's rows


class _ComplexRotary(torch.nn.Module):
    """Queries rotated by complex multiplication (Meta's Llama reference, torchtitan): ``view_as_complex``, a
    complex product with a buffer of unit complex numbers, ``view_as_real``; its backward conjugates (a view)."""

    def __init__(self, config: _RotaryConfig) -> None:
        super().__init__()
        self.config = config
        self.q = torch.nn.Linear(config.width, config.width)
        angles = torch.outer(torch.arange(config.max_len).float(), torch.arange(config.width // 2).float())
        self.register_buffer("rotation", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, W = x.shape
        q = torch.view_as_complex(self.q(x).reshape(B, S, W // 2, 2))  # (B, S, W/2) complex
        return torch.view_as_real(q * self.rotation[:S]).flatten(2).square().sum()  # (B, S, W)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_a_complex_product_costs_its_real_arithmetic_and_is_exact() -> None:
    """6 FLOPs per complex element (4 multiplies, 2 adds); the backward's conjugate had no rule (refused)."""
    import sympy
    from real_step import exact_against_a_real_step

    import symacct
    from symacct.cost.graph import records
    from symacct.symbols import sym

    model = _ComplexRotary(_RotaryConfig())
    acct = symacct.derive(model, optimizer="adamw", fixed=["width"])
    exact_against_a_real_step(model, acct)
    B, S = sym("B"), sym("S")
    complex_muls = [n for _, n in records(acct.graph) if n.op == "aten.mul.Tensor" and "complex64" in str(n.dtypes)]
    assert len(complex_muls) == 2  # the rotation, and its gradient (times the conjugate)
    assert all(sympy.expand(n.cost.flops_other - 6 * B * S * 8) == 0 for n in complex_muls)


class _PolarRotary(torch.nn.Module):
    """The rotation built in forward from its angles with ``torch.polar`` (Llama 4's rotary embedding), then
    applied as a complex product."""

    def __init__(self, config: _RotaryConfig) -> None:
        super().__init__()
        self.config = config
        self.q = torch.nn.Linear(config.width, config.width)
        self.register_buffer("freqs", torch.arange(config.width // 2).float() / config.width, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, W = x.shape
        angles = torch.outer(torch.arange(S, dtype=torch.float32), self.freqs)  # (S, W/2)
        rotation = torch.polar(torch.ones_like(angles), angles)  # (S, W/2) complex
        q = torch.view_as_complex(self.q(x).reshape(B, S, W // 2, 2))  # (B, S, W/2) complex
        return torch.view_as_real(q * rotation).flatten(2).square().sum()  # (B, S, W)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_polar_costs_a_cosine_a_sine_and_two_products_an_element() -> None:
    """``torch.polar`` had no rule (refused, as Llama 4's rotary embedding was): 4 FLOPs per complex element,
    and the step is exact against a real one."""
    import sympy
    from real_step import exact_against_a_real_step

    import symacct
    from symacct.cost.graph import records
    from symacct.symbols import sym

    model = _PolarRotary(_RotaryConfig())
    acct = symacct.derive(model, optimizer="adamw", fixed=["width"])
    exact_against_a_real_step(model, acct)
    polar = [n for _, n in records(acct.graph) if n.op == "aten.polar.default"]
    assert len(polar) == 1
    assert sympy.expand(polar[0].cost.flops_other - 4 * sym("S") * 8) == 0


@dataclasses.dataclass
class _SpanConfig:
    width: int = 8
    kernel: int = 3


class _Span(torch.nn.Module):
    """Patches of the sequence by ``nn.Unfold`` (ConvBERT's span-based convolution: ``aten.im2col``), mixed,
    then folded back by ``nn.Fold`` (``aten.col2im``: overlapping patches add)."""

    def __init__(self, config: _SpanConfig) -> None:
        super().__init__()
        self.config = config
        self.mix = torch.nn.Linear(config.width * config.kernel, config.width * config.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, width)
        B, S, W = x.shape
        k = self.config.kernel
        img = x.transpose(1, 2).unsqueeze(-1)  # (B, W, S, 1)
        cols = torch.nn.functional.unfold(img, (k, 1), padding=(k // 2, 0))  # (B, W*k, S)
        cols = self.mix(cols.transpose(1, 2)).transpose(1, 2)  # (B, W*k, S)
        out = torch.nn.functional.fold(cols, (S, 1), (k, 1), padding=(k // 2, 0))  # (B, W, S, 1)
        return out.square().mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, self.config.width),)


def test_unfold_is_a_copy_and_fold_adds_every_column_element() -> None:
    """``im2col`` and ``col2im`` had no rule (ConvBERT was refused): a copy, and one add per column element."""
    import sympy
    from real_step import exact_against_a_real_step

    import symacct
    from symacct.cost.graph import records
    from symacct.symbols import sym

    model = _Span(_SpanConfig())
    acct = symacct.derive(model, optimizer="adamw", fixed=["width", "kernel"])
    exact_against_a_real_step(model, acct)
    by_op = {n.op: n for _, n in records(acct.graph)}
    assert by_op["aten.im2col.default"].cost.flops_other == 0
    assert sympy.expand(by_op["aten.col2im.default"].cost.flops_other - 24 * sym("B") * sym("S")) == 0


@dataclasses.dataclass
class _BagConfig:
    vocab_size: int = 24
    n_embd: int = 8
    mode: str = "mean"
    weighted: bool = False  # per-sample weights (a learned weight per table row, looked up): sum mode only
    last_offset: bool = False  # flat indices with offsets, include_last_offset=True


class _Bags(torch.nn.Module):
    """nn.EmbeddingBag over each sequence (a bag of its S tokens), as a recommender's or fastText's input layer."""

    def __init__(self, config: _BagConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.bag = torch.nn.EmbeddingBag(c.vocab_size, c.n_embd, mode=c.mode, include_last_offset=c.last_offset)
        self.row_weight = torch.nn.Parameter(torch.rand(c.vocab_size)) if c.weighted else None
        self.head = torch.nn.Linear(c.n_embd, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, S)
        weights = self.row_weight[ids] if self.row_weight is not None else None  # (B, S)
        if self.config.last_offset:
            offsets = torch.arange(0, ids.numel() + 1, ids.shape[1])  # (B + 1,)
            bags = self.bag(ids.flatten(), offsets)  # (B, D)
        else:
            bags = self.bag(ids, per_sample_weights=weights)  # (B, D)
        return self.head(bags).square().mean()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab_size, (B, S)),)


@pytest.mark.parametrize(
    "mode, weighted, last_offset",
    [("sum", False, False), ("mean", False, False), ("max", False, False), ("sum", True, False),
     ("mean", False, True), ("max", False, True)],
)  # fmt: skip
def test_embedding_bag_exact_and_its_buffers_as_the_cpu_kernel_leaves_them(
    mode: str, weighted: bool, last_offset: bool
) -> None:
    """nn.EmbeddingBag had no rule (refused). Its CPU kernel leaves offset2bag (mean and max) a storage one index
    longer than its size, and bag_size (include_last_offset) one entry longer; both are saved for backward, so
    the saved bytes missed 8 until the trace took the CPU's storage (``eager.bag_buffers``). FLOPs other, by
    hand: n = B*S entries of D elements accumulated (a max compares), times 2 with per-sample weights, plus a
    mean's B*D divisions; the backward scatters each entry (a max only each bag's winners), scaled first."""
    import sympy
    from real_step import exact_against_a_real_step

    import symacct
    from symacct.cost.graph import records
    from symacct.symbols import sym

    model = _Bags(_BagConfig(mode=mode, weighted=weighted, last_offset=last_offset))
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)
    B, S, D = sym("B"), sym("S"), sym("D")
    by_op = {n.op: n.cost.flops_other for _, n in records(acct.graph) if "embedding_bag" in n.op}
    forward = B * S * D * (2 if weighted else 1) + (B * D if mode == "mean" else 0)
    backward = B * D if mode == "max" else B * S * D * (2 if weighted or mode == "mean" else 1)
    assert sympy.expand(by_op["aten._embedding_bag.default"] - forward) == 0
    assert sympy.expand(by_op["aten._embedding_bag_backward.default"] - backward) == 0
    if weighted:
        assert sympy.expand(by_op["aten._embedding_bag_per_sample_weights_backward.default"] - 2 * B * S * D) == 0


@dataclasses.dataclass
class _BoundedConfig:
    vocab_size: int = 24
    n_embd: int = 8


class _Bounded(torch.nn.Module):
    """nn.Embedding(max_norm=1.0): the looked-up rows renormalised in place before each lookup."""

    def __init__(self, config: _BoundedConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd, max_norm=1.0)
        self.head = torch.nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, S)
        return self.head(self.wte(ids)).square().mean()  # (B, S, V) -> ()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab_size, (B, S)),)


def test_embedding_max_norm_renormalises_the_rows_looked_up() -> None:
    """``embedding_renorm_`` had no rule (refused): 3 FLOPs per element of every row looked up (an upper bound:
    the kernel renormalises each distinct row once), exact against a real step otherwise."""
    import sympy
    from real_step import exact_against_a_real_step

    import symacct
    from symacct.cost.graph import records
    from symacct.symbols import sym

    model = _Bounded(_BoundedConfig())
    acct = symacct.derive(model, optimizer="adamw")
    exact_against_a_real_step(model, acct)
    renorm = [n.cost for _, n in records(acct.graph) if n.op == "aten.embedding_renorm_.default"]
    assert len(renorm) == 1
    B, S, D = sym("B"), sym("S"), sym("D")
    assert sympy.expand(renorm[0].flops_other - 3 * B * S * D) == 0
    assert sympy.expand(renorm[0].bytes_written - 4 * B * S * D) == 0
