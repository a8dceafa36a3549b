"""symacct verify: predicted vs measured on a real CPU step, with exit codes."""

from __future__ import annotations

import json

import pytest
import torch
from cli_run import cli

SMALL_GPT2 = [
    "--config",
    "n_layer=2",
    "--config",
    "n_embd=32",
    "--config",
    "vocab_size=64",
    "--config",
    "block_size=16",
]


def test_verify_cpu_every_row_exact():
    out = cli("verify", "gpt2", *SMALL_GPT2, "--config", "n_head=4", "--batch", "2", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)["rows"]
    names = {r["name"] for r in rows}
    assert {"matmul FLOPs, forward", "saved activation bytes", "memory: peak", "memory: after_optimizer"} <= names
    assert all(r["verdict"] == "ok" and r["relative_error"] == 0 for r in rows)
    # the measured side is what PyTorch counts: the forward's matmul FLOPs by FlopCounterMode, here
    from torch.utils.flop_counter import FlopCounterMode

    from symacct.models import GPT2, GPT2Config

    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=2, n_embd=32, vocab_size=64, block_size=16, n_head=4))
    with FlopCounterMode(display=False) as fc:
        model(*model.example_inputs(2, 16))
    forward = next(r for r in rows if r["name"] == "matmul FLOPs, forward")
    assert forward["measured"] == forward["predicted"] == fc.get_total_flops()


def test_verify_shows_flop_counter_gap_on_cpu_sdpa():
    out = cli("verify", "llama", "--config", "n_layers=1", "--config", "dim=32", "--config", "n_heads=4",
              "--config", "n_kv_heads=2", "--config", "vocab_size=64", "--config", "hidden_dim=48",
              "--config", "max_seq_len=16", "--config", "sdpa=true", "--batch", "2")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FlopCounterMode counts 0" in out.stdout


def test_verify_exits_1_on_a_mismatch_and_says_why():
    # B = 1: PyTorch views where it copies at other batch sizes, so saved bytes differ (FLOPs do not). (H = 1
    # no longer does: derive sees that the model runs other ops there and keeps H at 1.)
    out = cli("verify", "gpt2", *SMALL_GPT2, "--config", "n_head=2", "--config", "sdpa=true", "--batch", "1")
    assert out.returncode == 1
    assert "MISMATCH" in out.stdout and "note:" in out.stdout and "= 1" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_verify_cuda_without_cuda_is_one_line_exit_2():
    out = cli("verify", "gpt2", "--device", "cuda")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "CUDA" in out.stderr and not out.stdout


def test_verify_profile_matches_allocations_to_nodes():
    out = cli("verify", "gpt2", *SMALL_GPT2, "--config", "n_head=4", "--batch", "2", "--profile", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    prof = {r["op"]: r for r in report["profile"]}
    # the matmuls' outputs: what the graph says they allocate is what the profiler saw
    for op in ("aten::mm", "aten::addmm", "aten::bmm"):
        assert prof[op]["predicted"] == prof[op]["measured"] > 0
    assert isinstance(report["unpredicted_allocations"], dict)


def test_verify_steps_checks_the_steady_state():
    """Steps 2.. hold the optimizer states from the start: predicted by acct.steady, exact on CPU."""
    out = cli("verify", "gpt2", *SMALL_GPT2, "--config", "n_head=4", "--batch", "2", "--steps", "3", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["rows"]}
    later = [r for name, r in rows.items() if name.startswith("memory, steps 2-3: ")]
    assert len(later) == 4 and all(r["relative_error"] == 0 for r in later)
    # the states are live during the whole later step: its peak exceeds the first step's by at most their bytes
    first, steady = rows["memory: peak"]["measured"], rows["memory, steps 2-3: peak"]["measured"]
    assert first < steady <= first + rows["memory: optimizer"]["measured"]
    # derive's report gives the later steps' peak beside the first step's formulas: the one measured here
    out = cli("derive", "gpt2", *SMALL_GPT2, "--config", "n_head=4", "--batch", "2", "--json")
    assert json.loads(out.stdout)["later_steps"]["peak"] == steady
    out = cli("derive", "gpt2", *SMALL_GPT2, "--config", "n_head=4", "--batch", "2")
    assert f"the optimizer's states alive from the start): peak {steady} " in out.stdout


def test_verify_steps_must_be_positive():
    out = cli("verify", "cruncher", "--steps", "0")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--steps" in out.stderr


def test_verify_predict_is_for_cuda():
    """--predict chooses the route of a CUDA prediction (no-GPU or this GPU's trace): on the CPU it would do
    nothing, so it is refused rather than ignored."""
    out = cli("verify", "cruncher", "--predict", "gpu")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--device cuda" in out.stderr


def test_gpu_name_maps_to_the_catalog(monkeypatch):
    from symacct.errors import SymacctError
    from symacct.measure.verify import device_hardware

    for name, entry in (
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert device_hardware() == entry, name
    # a variant the catalog lacks is refused, not taken for its sibling with other peaks
    for name in ("Some GPU 9", "NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA A100 80GB PCIe", "NVIDIA H100 96GB"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        with pytest.raises(SymacctError, match="--hardware"):
            device_hardware()


def test_cuda_rows_from_given_measurements():
    """The CUDA rows' arithmetic, on made-up measurements (the measuring itself needs a GPU: test_cuda.py):
    reserved is the largest of the steps, time the median of steps 2.. (judged at 25 %), MFU the model FLOPs
    over that time at the dense peak of the step's dtype: the H200's 989 TFLOP/s for bf16 autocast, 67 TFLOP/s for fp32
    (../shared/REFERENCES.md).

    The reserved prediction, worked out by hand: every tensor of this tiny model is under 1 MiB, so all of
    them share the small pool's first 2 MiB segment (a few hundred 512-byte blocks at most), and the H200's
    32 MiB cuBLAS workspace (>= 10 MiB) takes a segment of its own: 34 MiB, judged at 5 %."""
    import symacct
    from symacct.measure.run import CudaSteps
    from symacct.measure.verify import _cuda_rows, render
    from symacct.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16))
    sizes = {"B": 2, "S": 8}
    run = CudaSteps(
        memory=[], reserved=[100, 300, 200], seconds=[0.9, 0.2, 0.4], workspace=33554432, context=500_000_000
    )
    for autocast, peak in (("bf16", 989e12), (None, 67e12)):
        acct = symacct.derive(model, autocast=autocast)
        at = acct.at(**sizes)
        rows = _cuda_rows(acct, at, run, sizes, "H200")
        reserved, workspace, context, time, mfu = rows
        assert reserved.measured == 300 and workspace.measured == 32 * 2**20
        assert reserved.predicted == 34 * 2**20 and reserved.tolerance == 0.05 and not reserved.ok
        # the CUDA context: the catalog's published figure beside the device's, shown
        assert (context.predicted, context.measured) == (287_047_680 - 20 * 2**20, 500_000_000)
        assert time.measured == pytest.approx(0.3) and "median of 2" in time.name and "H200" in time.name
        # judged at 25 %: a roofline of this tiny step is microseconds, far from 0.3 s (launches dominate)
        assert time.tolerance == 0.25 and time.predicted < 0.01 and not time.ok
        assert mfu.measured == pytest.approx(at.flops.total / (0.3 * peak)), autocast
        assert all(r.ok for r in (workspace, context, mfu))  # shown, never judged
        assert render(rows).count("shown") == 3


def test_an_unknown_gpu_is_refused_before_the_run(monkeypatch):
    """Without --hardware, a GPU the catalog lacks stops verify before anything runs on it."""
    import symacct
    import symacct.measure.verify as v
    from symacct.errors import SymacctError
    from symacct.models import GPT2, GPT2Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200 NVL")
    ran = []
    monkeypatch.setattr(v, "measure_cuda_steps", lambda *a, **k: ran.append(1))
    model = GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16))
    acct = symacct.derive(model)
    with pytest.raises(SymacctError, match="--hardware"):
        v.verify(model, acct, B=2, S=8, device="cuda")
    assert ran == []
