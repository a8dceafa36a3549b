"""Resource logs (symacct.track) and symacct diff: the OOM post-mortem workflow, on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from cli_run import cli

import symacct
from symacct.models import GPT2, Cruncher, CruncherConfig, GPT2Config

CFG = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def run(path, B: int, acct) -> list[dict]:
    torch.manual_seed(0)
    model = GPT2(CFG)
    args = model.example_inputs(B, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sizes = dict(B=B, S=16, L=2, D=32, H=4, V=64, S_max=16)
    with symacct.track(f"B{B}", path, model=model, args=args, acct=acct, sizes=sizes) as t:
        loss = model(*args)
        t.mark("after_forward")
        loss.backward()
        t.mark("after_backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.mark("after_optimizer")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_track_logs_measured_next_to_predicted_and_diff_points_at_activations(tmp_path):
    acct = symacct.derive(GPT2(CFG), optimizer="adamw")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    log_a = run(a, 2, acct)
    run(b, 6, acct)
    header, marks = log_a[0], log_a[1:]
    assert header["header"] and header["config"]["n_layer"] == 2 and header["sizes"]["B"] == 2
    assert [m["phase"] for m in marks] == ["after_forward", "after_backward", "after_optimizer"]
    for m in marks:  # CPU: the storage tracker sees exactly what derive predicts
        assert m["allocated"] == m["predicted"]
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["part_changed_most"] == "activations"
    assert report["phase_changed_most"] == "after_forward"
    assert report["module_changed_most"].startswith("blocks.*")


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
def test_diff_refuses_bad_logs(tmp_path):
    acct = symacct.derive(GPT2(CFG), optimizer="adamw")
    good = tmp_path / "good.jsonl"
    run(good, 2, acct)
    not_json = tmp_path / "bad.jsonl"
    not_json.write_text("hello\n")
    other = tmp_path / "other.jsonl"
    model = Cruncher(CruncherConfig(dim=8, n_layers=2))
    with symacct.track("c", other, model=model):
        model(*model.example_inputs(2)).backward()
    for args, needle in [((str(good), str(not_json)), "not JSON"), ((str(good), str(other)), "different models"),
                         ((str(good), str(tmp_path / "missing.jsonl")), "cannot read log")]:  # fmt: skip
        out = cli("diff", *args)
        assert out.returncode == 2 and needle in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout


def test_nothing_is_written_half_way(tmp_path):
    path = tmp_path / "crash.jsonl"
    model = Cruncher(CruncherConfig(dim=8, n_layers=2))
    try:
        with symacct.track("crash", path, model=model) as t:
            t.mark("after_forward")
            raise RuntimeError("out of memory")
    except RuntimeError:
        pass
    assert not path.exists()
