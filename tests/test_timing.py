"""Time and capacity: the seeds' worked examples, solver answers re-checked, catalog sanity, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from cli_run import cli

import symacct
from symacct.cost.graph import records
from symacct.models import GPT2, Cruncher, CruncherConfig, GPT2Config, Llama, LlamaConfig
from symacct.time.hardware import CATALOG, get, load, validate
from symacct.time.model import fit, max_params, roofline


def test_seed_training_time_70b_15t_1024_h100():
    est = symacct.estimate(params=70e9, tokens=15e12, hardware="H100-SXM", gpus=1024, mfu=0.5)
    # 6 * 70e9 * 15e12 / (989e12 * 0.5 * 1024)
    assert est.seconds == pytest.approx(6 * 70e9 * 15e12 / (989e12 * 0.5 * 1024))
    assert 1.2e7 <= est.seconds <= 1.3e7 and 143.5 <= est.days <= 146  # "about 144-146 days"
    assert "6 * N * tokens" in est.formula


def test_model_based_time_uses_derived_flops():
    from symacct.measure.run import measure_step

    model = GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16))
    acct = symacct.derive(model)
    sizes = dict(B=4, S=8)
    t = acct.time(hardware="A100", tokens=4 * 8 * 1000, gpus=2, mfu=0.4, **sizes)
    step_flops = measure_step(model, model.example_inputs(4, 8)).flops_total  # FlopCounterMode, a real step
    assert t.seconds == pytest.approx(1000 * step_flops / (312e12 * 0.4 * 2))


def test_mfu_round_trip():
    assert symacct.mfu(989e12 * 0.5 * 10, 10.0, "H100") == pytest.approx(0.5)


def bytes_per_param(**kw) -> float:
    return float(symacct.derive(Cruncher(CruncherConfig()), **kw).bytes_per_param())


def test_seed_capacity_examples_from_derived_bytes_per_param():
    adamw = bytes_per_param(optimizer="adamw")
    assert adamw == 16
    # 8 x H100 80 GB, AdamW, static memory only, no reserve: 40B parameters
    assert max_params(hardware="H100-SXM", gpus=8, bytes_per_param=adamw, reserve=0) == pytest.approx(40e9)
    # the 16 is what a real AdamW step holds: params + grads + m + v, counted on real tensors
    torch.manual_seed(0)
    real = Cruncher(CruncherConfig())
    opt = torch.optim.AdamW(real.parameters())
    real(*real.example_inputs(4)).backward()
    opt.step()
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    held = sum(
        t.untyped_storage().nbytes() for t in [*real.parameters(), *(p.grad for p in real.parameters()), *states]
    )
    assert held == adamw * sum(p.numel() for p in real.parameters())
    inference = bytes_per_param(step="forward", params_dtype=torch.bfloat16)
    bf16 = Cruncher(CruncherConfig()).to(torch.bfloat16)
    assert inference * sum(p.numel() for p in bf16.parameters()) == sum(
        p.untyped_storage().nbytes() for p in bf16.parameters()
    )


def test_llama2_7b_static_memory_derived():
    with torch.device("meta"):
        model = Llama(LlamaConfig())
    acct = symacct.derive(model, optimizer="adamw")
    mem = acct.at(B=1, S=1).memory
    n = 6_738_415_616
    static = mem.params + mem.grads + mem.optimizer
    # 16 bytes per parameter plus AdamW's fp32 step counter per parameter tensor
    n_tensors = sum(1 for _ in model.parameters())
    assert static == 16 * n + 4 * n_tensors


@pytest.mark.parametrize("symbol,fixed", [("B", {"S": 1024}), ("S", {"B": 8}), ("L", {"B": 8, "S": 1024})])
def test_fit_answers_fit_and_the_next_size_does_not(symbol, fixed):
    with torch.device("meta"):
        acct = symacct.derive(GPT2(GPT2Config()), optimizer="adamw")
    res = fit(acct, symbol, hardware="H100-SXM", reserve=0.15, **fixed)
    budget = int(80e9 * 0.85)
    assert res.budget_bytes == budget
    for v, fits in ((res.value, True), (res.value + 1, False)):
        sizes = {**fixed, symbol: v, **({"S_max": max(1024, v)} if symbol == "S" else {})}
        later = acct.steady(**sizes)["peak"]  # a step after the first: AdamW's m and v alive from its start
        assert (max(acct.at(**sizes).memory.peak, later) <= budget) == fits


def test_fit_holds_every_step_not_only_the_first():
    """AdamW makes its states in the first step's optimizer phase, after the activations are freed; every later
    step holds them from its start, beside the activations. fit used to search the first step's peak, so it
    answered a batch whose second step does not fit: GPT-2 under bf16 autocast on an H100 at S = 1024, B = 35
    (first step 67.6 GB, later steps 68.6 GB, budget 68.0 GB). Now every step of the answer fits."""
    with torch.device("meta"):
        acct = symacct.derive(GPT2(GPT2Config()), optimizer="adamw", autocast="bf16")
    res = fit(acct, "B", hardware="H100-SXM", reserve=0.15, S=1024)
    budget = int(80e9 * 0.85)
    first, later = acct.at(B=res.value + 1, S=1024).memory.peak, acct.steady(B=res.value + 1, S=1024)["peak"]
    assert first <= budget < later  # the next batch's first step fits; its second does not
    assert acct.steady(B=res.value, S=1024)["peak"] == res.peak_bytes <= budget
    assert "every step" in res.formula


def test_catalog_sanity():
    for a in CATALOG.values():
        validate(a)  # positive figures, dense <= sparse, a source
        assert a.source
        for k, sparse in a.sparse.items():
            # the sparsity headline is about 2x dense: H100 989 -> 1979 (rounded); L40S's datasheet
            # pairs 362 dense with 733 sparse, 1.2 % off 2x, so the check allows 2 %
            assert a.peak[k] * 2 == pytest.approx(sparse, rel=0.02)
    assert get("H100-SXM").peak_flops("bf16") == 989e12  # not 1979 (that is with sparsity)
    with pytest.raises(symacct.SymacctError, match="no fp8"):
        get("A100").peak_flops("fp8")
    assert get("h100").name == "H100-SXM"
    assert get("A100").memory_bytes == 80 * 10**9


def test_user_hardware_from_json(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            [{"name": "MyChip", "peak": {"bf16": 100}, "memory_gb": 32, "bandwidth_tbs": 1.0, "source": "my lab"}]
        )
    )
    (chip,) = load(path)
    assert get("mychip").peak_flops("bf16") == 100e12 and chip.memory_bytes == 32e9
    bad = tmp_path / "bad.json"
    bad.write_text("[{}]")
    with pytest.raises(symacct.SymacctError, match="cannot read hardware file"):
        load(bad)


def test_roofline_sums_and_bounds():
    model = Cruncher(CruncherConfig(dim=64, n_layers=2))
    acct = symacct.derive(model, autocast=torch.bfloat16)
    big = roofline(acct, "H100-SXM", B=8192, D=8192, L=8)
    assert big.seconds == pytest.approx(sum(big.by_phase.values()))
    assert big.seconds == pytest.approx(sum(big.by_module.values()))
    # large bf16 matmuls are compute-bound: the implied MFU approaches the matmul share of the time
    assert 0.5 < big.mfu <= 1.0
    nodes = {n: a for n, a in records(big.graph) if a.phase != "input"}
    assert set(big.by_node) == set(nodes)
    assert all(t.bound in ("compute", "memory") and t.seconds >= 0 for t in big.by_node.values())
    n, mm = next((n, a) for n, a in nodes.items() if a.op.startswith("aten.mm") and a.count)
    assert big.by_node[n].bound == "compute"
    assert big.by_node[n].seconds == pytest.approx(mm.cost.flops / 989e12)  # bf16 tensor-core peak
    small = roofline(acct, "H100-SXM", B=2, D=64, L=2)
    assert small.memory_bound_seconds > 0 and small.mfu < big.mfu


def test_cli_estimate_and_fit_json():
    out = cli("estimate", "--params", "70e9", "--tokens", "15e12", "--hardware", "H100-SXM", "--gpus", "1024",
              "--mfu", "0.5", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) >= {"seconds", "days", "flops", "formula"} and 143.5 <= report["days"] <= 146
    out = cli("fit", "--hardware", "H100-SXM", "--gpus", "8", "--optimizer", "adamw", "--reserve", "0", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["params"] == pytest.approx(40e9) and report["bytes_per_param"] == 16


@pytest.mark.parametrize(
    "args,needle",
    [
        (["estimate", "--params", "70e9", "--tokens", "1e12", "--hardware", "H10"], "did you mean"),
        (["estimate", "--params", "70e9", "--tokens", "1e12", "--hardware", "H100", "--mfu", "1.5"], "MFU"),
        (["estimate", "--params", "70e9", "--tokens", "1e12", "--hardware", "H100", "--mfu", "0"], "MFU"),
        (["estimate", "--params", "-5", "--tokens", "1e12", "--hardware", "H100"], "non-negative"),
        (["estimate", "--params", "lots", "--tokens", "1e12", "--hardware", "H100"], "not a number"),
        (["fit", "--hardware", "H100", "--reserve", "1.5"], "reserve"),
    ],
)
def test_cli_bad_numbers_are_one_line_exit_2(args, needle):
    out = cli(*args)
    assert out.returncode == 2
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1
