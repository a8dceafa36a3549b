"""Formula sheets: layout, numbers against acct.at and FlopCounterMode, determinism, plots, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy
import torch
from cli_run import cli
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct.formula import latex, negligible_terms, text
from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
from symacct.report import sheet
from symacct.symbols import B, D, H, L, S, V, sym

SMALL = {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 96, "block_size": 64}


def test_formula_layout_is_fixed():
    """Stack collected as L(...), symbols in B S L D H order, leading terms first, tiny terms grey."""
    e = 12 * B * D * L * S**2 + 72 * B * D**2 * L * S + 6 * B * D * S * V + 2 * D * L
    assert text(e) == "L*(12*B*S**2*D + 72*B*S*D**2 + 2*D) + 6*B*S*D*V"  # by degree, then text
    values = {"B": 8, "S": 1024, "L": 12, "D": 768, "V": 50257}
    assert text(e, values) == "L*(72*B*S*D**2 + 12*B*S**2*D + 2*D) + 6*B*S*D*V"  # by value at the sizes
    assert latex(e, values) == (r"L \left(72 B S D^{2} + 12 B S^{2} D + {\color{gray} 2 D}\right) + 6 B S D V")
    assert negligible_terms(e, values) == ["2*L*D"]
    assert text(sym("D") ** 2 * sym("H_kv") / H) == "D**2*H_kv/H"
    assert latex(sym("S_max") * D) == r"D S_{\max}"
    assert text(sympy.Max(2 * B, D + 1)) == "Max(2*B, D + 1)"
    assert text(sympy.Integer(0)) == "0"


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(**SMALL, tie_weights=False))
    acct = symacct.derive(model, optimizer="adamw")
    return model, acct, sheet.build(acct, name="gpt2", B=3, S=20)


def test_sheet_totals_match_a_real_step(small):
    """The sheet's totals against independent counts of a real CPU step: the parameter count, FlopCounterMode,
    saved_tensors_hooks and the storage tracker (peak and phase points)."""
    from symacct.measure.run import measure_memory, measure_step

    model, _, sh = small
    by_name = {t["name"]: t["value"] for t in sh["totals"]}
    assert {n["symbol"]: n["value"] for n in sh["notation"]} == {
        "B": 3, "S": 20, "L": 3, "D": 32, "H": 4, "V": 96, "S_max": 64,
    }  # fmt: skip
    assert by_name["params"] == sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    args = model.example_inputs(3, 20)
    counted = measure_step(model, args)
    assert by_name["flops.forward"] == counted.flops_forward and by_name["flops.backward"] == counted.flops_backward
    assert by_name["flops.total"] == counted.flops_total  # AdamW does no matmuls
    assert by_name["memory.activations"] == counted.saved_bytes
    model.zero_grad(set_to_none=True)
    real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    assert by_name["memory.peak"] == real.peak
    assert (by_name["memory.after_forward"], by_name["memory.after_backward"]) == (
        real.after_forward,
        real.after_backward,
    )
    # each component's rows add up to its subtotal, and the subtotals to the totals
    for comp in sh["components"]:
        sub = comp["subtotal"]
        for key in sub:
            assert sum(r[key]["value"] for r in comp["rows"] if key in r) == sub[key]["value"]
    saved = sum(c["subtotal"].get("saved_bytes", {"value": 0})["value"] for c in sh["components"])
    assert saved == counted.saved_bytes


def test_sheet_rows_match_flop_counter_per_module(small):
    """Each leaf module's matmul FLOPs (forward + backward, all layers) equal FlopCounterMode's on a real step."""
    model, _, sh = small
    counter = FlopCounterMode(display=False)
    with counter:
        model(*model.example_inputs(3, 20)).backward()
    counts = counter.get_flop_counts()
    rows = {r["module"]: r for c in sh["components"] for r in c["rows"]}
    for path in ("blocks.*.attn.c_attn", "blocks.*.attn.c_proj", "blocks.*.mlp.c_fc", "blocks.*.mlp.c_proj"):
        measured = sum(sum(counts[f"GPT2.{path.replace('*', str(i))}"].values()) for i in range(SMALL["n_layer"]))
        predicted = rows[path]["matmul_forward"]["value"] + rows[path]["matmul_backward"]["value"]
        assert predicted == measured, path
    head = rows["lm_head"]
    assert head["matmul_forward"]["value"] + head["matmul_backward"]["value"] == sum(counts["GPT2.lm_head"].values())
    total = sum(r.get(k, {"value": 0})["value"] for r in rows.values() for k in ("matmul_forward", "matmul_backward"))
    assert total == counter.get_total_flops()


def test_renderers_hold_every_value(small):
    _, _, sh = small
    md, tex, js = sheet.render_md(sh), sheet.render_tex(sh), sheet.render_json(sh)
    assert json.loads(js) == json.loads(json.dumps(sh))
    for t in sh["totals"]:
        assert f"{t['value']:,}" in md and f"{t['value']}" in tex
        assert f"${t['latex']}$" in md
    assert tex.startswith(r"\documentclass") and tex.rstrip().endswith(r"\end{document}")
    assert md.count("| **subtotal** |") == len(sh["components"])


def test_crossover_is_where_attention_equals_projections():
    """gpt2: 12 B S^2 D = 72 B S D^2 at S = 6D. Llama (H_kv = H): S^2 terms 12 B S^2 D vs 6 B S (4 D^2 + 3 D F)."""
    g = symacct.derive(GPT2(GPT2Config(**SMALL)))
    assert g.crossover() == 6 * SMALL["n_embd"]
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=50, hidden_dim=96, max_seq_len=32)
    lm = symacct.derive(Llama(cfg))
    assert lm.crossover() == (4 * 64 + 3 * 96) / 2


def _cli(*args: str, seed: str = "0", cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    return subprocess.run(
        [sys.executable, "-m", "symacct.cli", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


@pytest.mark.slow
def test_sheet_files_are_byte_identical_across_hash_seeds(tmp_path):
    cfg = [f"--config={k}={v}" for k, v in SMALL.items()]
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"run{seed}"
        r = _cli(
            "sheet", "gpt2", *cfg, "--batch", "4", "--seq", "32", "--autocast", "bf16", "--out", str(out), seed=seed
        )
        assert r.returncode == 0, r.stderr
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    assert {Path(n).suffix for n in names} == {".md", ".tex", ".json", ".png", ".svg"}
    assert len([n for n in names if n.endswith(".png")]) == 3  # memory vs S, vs B, FLOP share
    for n in names:
        assert (outs[0] / n).read_bytes() == (outs[1] / n).read_bytes(), n
    assert not [p for p in outs[0].iterdir() if p.name.startswith(".")]  # no staging left behind


def _run(*args: str) -> tuple[int, str, str]:
    done = cli(*args)  # in this process (cli_run)
    return done.returncode, done.stdout, done.stderr


def test_sheet_stdout_formats_agree(capsys):
    cfg = [f"--config={k}={v}" for k, v in SMALL.items()]
    runs = {
        fmt: _run("sheet", "gpt2", *cfg, "--batch", "4", "--seq", "32", "--format", fmt)
        for fmt in ("md", "json", "text")
    }
    assert all(code == 0 for code, _, _ in runs.values())
    data = json.loads(runs["json"][1])
    assert runs["md"][1] == sheet.render_md(data)
    for t in data["totals"]:
        assert f"{t['value']:,}" in runs["text"][1]  # the rich tables carry the same exact values


@pytest.mark.parametrize(
    "args, message",
    [
        (["sheet", "gtp2"], "did you mean gpt2"),
        (["sheet", "no_such_module:make"], "cannot import"),
        (["sheet", "gpt2", "--config", "n_layer"], "KEY=VALUE"),
        (["sheet", "gpt2", "--config", "n_layers=2"], "did you mean n_layer"),
        (["sheet", "gpt2", "--mfu", "2"], "--mfu"),
        (["sheet", "gpt2", "--hardware", "Z9000"], "Z9000"),
        (["sheet", "gpt2", "--format", "pdf"], "invalid choice"),
    ],
)
def test_sheet_bad_input_is_one_line_exit_2(capsys, args, message):
    try:
        code, out, err = _run(*args)
    except SystemExit as e:  # argparse's own errors leave through sys.exit
        code, (out, err) = e.code, capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_unwritable_out_writes_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = _cli("sheet", "cruncher", "--out", str(blocker / "sub"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot write" in r.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions: the blocker case above still ran
            return
        r = _cli("sheet", "cruncher", "--out", str(ro))
        assert r.returncode == 2 and "cannot write" in r.stderr
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_notebook_reprs(small):
    _, acct, _ = small
    md = acct._repr_markdown_()
    assert f"${latex(acct.params)}$" in md and f"${latex(acct.flops.total)}$" in md
    tex = acct._repr_latex_()
    assert tex.startswith("$$") and latex(acct.memory.activations) in tex
    at = acct.at(B=3, S=20)
    md_at = at._repr_markdown_()
    assert f"${at.params:,}$".replace(",", "{,}") in md_at
    assert f"${at.flops.total:,}$".replace(",", "{,}") in md_at


def test_forward_and_checkpointed_sheets_show_what_the_step_does():
    fwd = symacct.derive(GPT2(GPT2Config(**SMALL)), step="forward")
    sh = sheet.build(fwd, name="gpt2", B=2, S=16)
    assert [k for k, _ in sheet.columns(sh)] == ["matmul_forward", "other_forward", "params"]
    assert not {"flops.backward", "memory.grads", "memory.activations"} & {t["name"] for t in sh["totals"]}
    ck = symacct.derive(GPT2(GPT2Config(**SMALL, checkpoint=True)), optimizer="sgd")
    sh = sheet.build(ck, name="gpt2", B=2, S=16)
    assert "matmul_recompute" in [k for k, _ in sheet.columns(sh)]
    recompute = sum(c["subtotal"].get("matmul_recompute", {"value": 0})["value"] for c in sh["components"])
    assert recompute == ck.at(B=2, S=16).flops.recompute > 0
