"""torch.fx in and out (symacct.cost.fx).

Out: ``acct.fx`` is the traced step as a GraphModule whose nodes carry the networkx graph's own records;
run on fake tensors at the probe's sizes it must reproduce every recorded output shape, and FlopCounterMode
(with the CPU flash-attention kernel counted by flop_counter's formulas, which FlopCounterMode leaves out)
counting that run must equal the nodes' matmul FLOPs: an independent count of the graph itself.

In: ``symacct.annotate`` on a torch.export program with a dynamic batch and sequence length gives formulas
in B and S equal to derive's forward formulas at the model's other sizes; make_fx graphs with dims renamed;
refusals name the node.
"""

from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim, export
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct.cost.fx import annotate
from symacct.cost.graph import records
from symacct.cost.rules import Cost
from symacct.errors import SymacctError
from symacct.measure.run import CpuFlashCounter
from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
from symacct.symbols import sym

GPT2_SMALL = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, block_size=32)
LLAMA_SMALL = LlamaConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=160, max_seq_len=32, sdpa=True
)


def _derived(model: torch.nn.Module, **options):
    return symacct.derive(model, **options)


def _probe_values(acct) -> dict[str, int]:
    """Each symbol's probe value, read where a node's formula shape is that bare symbol and the trace has
    the integer (B, S, D, V, ... appear bare in some shape)."""
    values: dict[str, int] = {}
    for rec in acct.step.ops:
        node = acct.graph.nodes[rec.index]["node"]
        for formula, traced in zip(node.shapes, rec.outputs):
            for f, n in zip(formula, traced.shape):
                if isinstance(f, sympy.Symbol):
                    assert values.setdefault(f.name, n) == n
    return values


def _phase_sums(acct) -> dict[str, Cost]:
    by: dict[str, list[Cost]] = {}
    for node in acct.fx.graph.nodes:
        rec = node.meta.get("symacct")
        if node.op == "call_function" and rec is not None:
            by.setdefault(rec.phase, []).append(rec.cost * rec.count)
    return {ph: Cost.total(cs).map(sympy.expand) for ph, cs in by.items()}


def _check_totals(acct) -> None:
    sums = _phase_sums(acct)
    zero = Cost(bytes_read=0, bytes_written=0)

    def of(field: str, *phases: str):
        return sympy.expand(sum((getattr(sums.get(ph, zero), field) for ph in phases), sympy.Integer(0)))

    assert of("flops", "forward") == acct.flops.forward
    assert of("flops", "backward") == acct.flops.backward
    assert of("flops", "optimizer") == acct.flops.optimizer
    assert of("flops_other", "forward", "backward", "optimizer", "recompute") == acct.flops.other
    assert of("bytes_read", *sums) == acct.bytes.read
    assert of("bytes_written", *sums) == acct.bytes.written
    saved = [n.meta["symacct"] for n in acct.fx.graph.nodes if n.op == "call_function" and "symacct" in n.meta]
    assert sympy.expand(sum((r.saved_bytes * r.count for r in saved), sympy.Integer(0))) == acct.memory.activations


def _check_nodes(acct) -> None:
    gm = acct.fx
    keyed = [n for n in gm.graph.nodes if "symacct_key" in n.meta]
    ops = [n for n in keyed if n.op == "call_function"]
    assert [n.meta["symacct_key"] for n in ops] == [r.index for r in acct.step.ops]
    for n in keyed:
        assert n.meta["symacct"] is acct.graph.nodes[n.meta["symacct_key"]]["node"]
        if n.op == "call_function":
            assert str(n.target) == n.meta["symacct"].op
    placeholders = {n.meta["symacct_key"] for n in keyed if n.op == "placeholder"}
    assert placeholders == {k for k, r in records(acct.graph) if r.phase == "input"}


def _run_on_fakes(acct) -> tuple[int, int]:
    """Run acct.fx on fake tensors at the probe's sizes; every output shape must be the one recorded.
    Returns (FLOPs counted by FlopCounterMode and the CPU flash counter, the nodes' matmul FLOPs)."""
    gm = acct.fx
    step = acct.step
    recorded = {r.index: r for r in step.ops}
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    shapes = [(ph.meta.shape, ph.meta.dtype) for ph in step.placeholders]
    # tensors made from Python data (AdamW's step counters) come after, as inputs too
    shapes += [n.meta["symacct_constant"] for n in gm.graph.nodes if "symacct_constant" in n.meta]
    assert len(shapes) == len([n for n in gm.graph.nodes if n.op == "placeholder"])
    with mode:  # a 0-d constant as torch.tensor makes it: fake mode keeps its value (AdamW reads step.item())
        args = [
            torch.tensor(0, dtype=dtype) if shape == () else torch.zeros(shape, dtype=dtype) for shape, dtype in shapes
        ]

    class Checking(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and "symacct_key" in n.meta:
                rec = recorded[n.meta["symacct_key"]]
                got = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                assert got == [tuple(t.shape) for t in rec.outputs], (n.name, got, rec.outputs)
            return out

    counter, flash = FlopCounterMode(display=False), CpuFlashCounter()
    with mode, counter, flash:
        Checking(gm).run(*args)
    values = _probe_values(acct)
    subs = {sym(k): v for k, v in values.items()}
    derived = 0
    for n in gm.graph.nodes:
        rec = n.meta.get("symacct")
        if n.op == "call_function" and rec is not None:
            derived += int(sympy.sympify(rec.cost.flops + rec.cost.flops_recompute).xreplace(subs))
    return counter.get_total_flops() + flash.total, derived


def test_gpt2_fx_is_the_step_node_for_node():
    acct = _derived(GPT2(GPT2_SMALL), optimizer="adamw")
    _check_nodes(acct)
    _check_totals(acct)
    counted, derived = _run_on_fakes(acct)
    assert counted == derived and counted > 0


def test_llama_fx_is_the_step_node_for_node():
    acct = _derived(Llama(LLAMA_SMALL), optimizer="adamw")
    _check_nodes(acct)
    _check_totals(acct)
    counted, derived = _run_on_fakes(acct)
    assert counted == derived and counted > 0


def test_an_evaluated_copy_gives_numbers():
    acct = _derived(GPT2(GPT2_SMALL)).at(B=2, S=8)
    flops = sum(
        n.meta["symacct"].cost.flops * n.meta["symacct"].count
        for n in acct.fx.graph.nodes
        if n.op == "call_function" and "symacct" in n.meta
    )
    assert flops == acct.flops.forward + acct.flops.backward + acct.flops.optimizer
    assert isinstance(flops, int) or flops.is_Integer


def _forward_at_model_sizes(acct, field: str):
    """derive's forward formula with every size but B and S at the model's own value."""
    subs = {sym(k): v for k, v in acct.symbols.items() if k not in ("B", "S")}
    return sympy.expand(sympy.sympify(field).xreplace(subs))


def _exported(model, vocab: int, s_max: int):
    idx = torch.randint(0, vocab, (2, 8))
    B, S = Dim("B"), Dim("S", max=s_max - 1)
    return export(model, (idx, idx.clone()), dynamic_shapes=({0: B, 1: S}, {0: B, 1: S}))


def _check_export_equals_derive(model, vocab: int, s_max: int) -> None:
    a = annotate(_exported(model, vocab, s_max))
    acct = _derived(model)
    assert set(a.symbols) == {"B", "S"}
    assert a.cost.flops == _forward_at_model_sizes(acct, acct.flops.forward)
    assert a.cost.flops_other == _forward_at_model_sizes(acct, acct.flops.other_forward)
    assert a.cost.bytes_read == _forward_at_model_sizes(acct, acct.bytes.read_forward)
    assert a.cost.bytes_written == _forward_at_model_sizes(acct, acct.bytes.written_forward)
    assert a.cost.flops.free_symbols == {sym("B"), sym("S")}


def test_gpt2_export_equals_derive_forward():
    _check_export_equals_derive(GPT2(GPT2_SMALL), 100, 32)


def test_llama_export_equals_derive_forward():
    _check_export_equals_derive(Llama(LLAMA_SMALL), 96, 32)


def test_annotate_writes_node_meta_and_totals():
    a = annotate(_exported(GPT2(GPT2_SMALL), 100, 32))
    costed = [n for n in a.graph_module.graph.nodes if "symacct" in n.meta]
    assert {n.name for n in costed} == set(a.nodes)
    assert Cost.total(n.meta["symacct"].cost for n in costed).map(sympy.expand) == a.cost
    assert any(n.meta["symacct"].module.startswith("blocks.0.attn") for n in costed)
    linear = next(n for n in costed if n.target is torch.ops.aten.linear.default)
    assert [op for op, _ in a.ops[linear.name]] != ["aten.linear.default"]  # decomposed as in eager
    at = a.at(B=2, S=8)
    assert at.flops == int(a.cost.flops.xreplace({sym("B"): 2, sym("S"): 8}))
    sheet = a.sheet()
    assert "| B |" in sheet and "matmul FLOPs" in sheet and "blocks.0.attn" in sheet


def test_make_fx_symbolic_with_dims_renamed():
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(16, 24)

    def f(x):
        return torch.relu(x @ w).sum()

    gm = make_fx(f, tracing_mode="symbolic", _allow_non_fake_inputs=True)(torch.randn(5, 16))  # w: a constant
    plain = annotate(gm)  # x's columns are pinned to 16 by the product: one symbol left, named as make_fx names it
    assert len(plain.symbols) == 1
    (name,) = plain.symbols
    a = annotate(gm, dims={name: "B"})
    B = sym("B")
    assert a.cost.flops == 2 * B * 16 * 24  # one (B x 16) @ (16 x 24) product
    assert a.cost.flops_other == B * 24 + B * 24  # relu and the sum, one per element
    assert a.phase == "graph" and a.notes

    # make_fx in real mode: every size a number; x read twice by x @ x is one tensor, read once
    def g(x):
        return x @ x

    real = annotate(make_fx(g)(torch.randn(5, 5)))
    assert real.cost.flops == 2 * 5 * 5 * 5 and real.symbols == {}
    assert real.cost.bytes_read == 5 * 5 * 4 and real.cost.bytes_written == 5 * 5 * 4


def test_refusals_name_the_node():
    import pytest

    from symacct.cost.rules import lookup

    # an op with no rule: the node is named
    op = next(
        o for o in (torch.ops.aten.linalg_cholesky_ex.default, torch.ops.aten.cholesky.default) if lookup(o) is None
    )

    class M(torch.nn.Module):
        def forward(self, x):
            return op(x @ x.transpose(-1, -2))

    ep = export(M(), (torch.randn(4, 4),))
    with pytest.raises(SymacctError) as e:
        annotate(ep)
    assert "no cost rule" in str(e.value) and e.value.node is not None and "cholesky" in str(e.value)

    # a graph of modules (symbolic_trace) is not aten ops
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    with pytest.raises(SymacctError) as e:
        annotate(gm)
    assert "call_module" in str(e.value)

    # dims naming a size the program does not have
    with pytest.raises(SymacctError) as e:
        annotate(_exported(GPT2(GPT2_SMALL), 100, 32), dims={"T": "S"})
    assert "T" in str(e.value)

    with pytest.raises(SymacctError):
        annotate(torch.nn.Linear(2, 2))


def test_a_data_dependent_size_is_refused():
    import pytest

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x).float().sum()

    ep = export(M(), (torch.randn(6),))
    with pytest.raises(SymacctError) as e:
        annotate(ep)
    assert "depends on the data" in str(e.value) and e.value.node is not None


def _wiring(graph: torch.fx.Graph) -> tuple[list[str], list[tuple]]:
    """The aten ops in order, and where each takes its tensor arguments from: the position of the op that
    made it (through getitem: and which part), or 'ext' for a parameter, buffer or input."""
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    pos = {n: i for i, n in enumerate(ops)}

    def src(x: torch.fx.Node):
        if x.op == "call_function" and x.target is operator.getitem:
            return (src(x.args[0]), x.args[1])
        return pos.get(x, "ext")

    wires = [
        tuple(
            src(x) if isinstance(x, torch.fx.Node) else "const"
            for x in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
        )
        for n in ops
    ]
    return [str(n.target) for n in ops], wires


def _same_as_make_fx(model: torch.nn.Module, vocab: int) -> None:
    """acct.fx against make_fx of the same training step (forward and backward) of a model with as many blocks as
    the probe (4), so that the two graphs have the same ops: the same aten ops in the same order, each reading
    its tensors from the same ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    acct = _derived(model)
    idx = torch.randint(0, vocab, (2, 8))

    def step(idx, targets):
        # derive traces with saved-tensor hooks set (their presence changes the ops of some models)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(idx, targets)
        loss.backward()
        return loss

    theirs = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(idx, idx.clone())
    ours_ops, ours_wires = _wiring(acct.fx.graph)
    their_ops, their_wires = _wiring(theirs.graph)
    assert ours_ops == their_ops
    assert ours_wires == their_wires


def test_gpt2_fx_is_what_make_fx_records():
    _same_as_make_fx(GPT2(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=100, block_size=32)), 100)


def test_llama_fx_is_what_make_fx_records():
    cfg = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=160, max_seq_len=32)
    _same_as_make_fx(Llama(cfg), 96)


def test_core_aten_keeps_the_matmul_flops():
    """Decomposed to core aten, a program runs other kernels for dropout and the loss (other FLOPs and bytes
    follow the ops it holds) but the same products."""
    ep = _exported(GPT2(GPT2_SMALL), 100, 32)
    eager, core = annotate(ep), annotate(ep.run_decompositions())
    assert core.cost.flops == eager.cost.flops
    assert "aten.native_dropout" in core.by_op() and "aten.native_dropout" not in eager.by_op()


@pytest.mark.slow  # export, save and the CLI in a subprocess: tens of seconds (CI's slow pass)
def test_cli_annotates_a_saved_program(tmp_path):
    import json
    import subprocess
    import sys

    ep = _exported(GPT2(GPT2_SMALL), 100, 32)
    path = tmp_path / "gpt2.pt2"
    torch.export.save(ep, path)
    cli = [sys.executable, "-m", "symacct.cli", "annotate", str(path)]
    # a loaded program keeps its symbols but not the Dim names: dims by placeholder position
    done = subprocess.run([*cli, "--json", "--dims", "idx.0=N", "--dims", "idx.1=S"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    expect = annotate(ep, dims={"B": "N"})
    assert sympy.sympify(got["totals"]["flops"].replace("^", "**"), locals={"S": sym("S"), "N": sym("N")}) == (
        expect.cost.flops
    )
    assert set(got["symbols"]) == {"N", "S"}
    sheet = subprocess.run(cli, capture_output=True, text=True)
    assert sheet.returncode == 0 and sheet.stdout.startswith("# Costs of an fx program")
    for bad in (["annotate", str(tmp_path / "missing.pt2")], ["annotate", str(path), "--dims", "B"]):
        done = subprocess.run([sys.executable, "-m", "symacct.cli", *bad], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("symacct: error:")


def test_transformers_export_matmul_flops_equal_derive():
    """A transformers Llama exported with dynamic B and S: the same products as derive's forward. Its other
    element-wise costs differ, rightly: under export transformers builds the causal mask as a tensor (the
    program holds it) where eager SDPA takes is_causal; and export writes size checks into the program
    (aten._assert_tensor_metadata: no data read)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg)

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, labels):
            return self.m(input_ids=input_ids, labels=labels, use_cache=False).loss

    ids = torch.randint(0, 128, (2, 8))
    B, S = Dim("B"), Dim("S", max=63)
    a = annotate(export(Loss(), (ids, ids), dynamic_shapes=({0: B, 1: S}, {0: B, 1: S})))
    acct = _derived(model)
    assert a.cost.flops == _forward_at_model_sizes(acct, acct.flops.forward)
    assert "aten._assert_tensor_metadata" in a.by_op() and a.by_op()["aten._assert_tensor_metadata"].bytes_read == 0
