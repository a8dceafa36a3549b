"""Every README example runs: the Python blocks are executed, the CLI lines are run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
PY_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
CLI_LINES = [
    line.strip()
    for block in re.findall(r"```bash\n(.*?)```", README, re.S)
    for line in block.splitlines()
    if line.strip().startswith("symacct ")
]


def _value(comment: str) -> str | None:
    """The result a '# ...' comment states (before any ': explanation'), or None for a description."""
    head = comment.split(": ", 1)[0].strip()
    if re.fullmatch(r"-?[0-9][0-9,_]*(\.[0-9]+)?", head):
        return head
    if re.fullmatch(r"[A-Za-z0-9_*+\-/() .]+", head) and re.search(r"[*+]", head) and "  " not in head:
        return head
    return None


def _same(printed: str, stated: str) -> bool:
    """A printed result equals the stated one: integers exactly (commas ignored), decimals to the stated
    places, formulas as sympy expressions."""
    import sympy

    if re.fullmatch(r"-?[0-9][0-9,_]*", stated):
        return printed.strip() == stated.replace(",", "").replace("_", "")
    if re.fullmatch(r"-?[0-9][0-9,_]*\.[0-9]+", stated):
        places = len(stated.split(".")[1])
        return round(float(printed), places) == float(stated.replace(",", ""))

    def parse(text: str) -> sympy.Expr:  # every name a plain symbol (S is not sympy's singleton here)
        return sympy.sympify(text, locals={n: sympy.Symbol(n) for n in re.findall(r"[A-Za-z_]\w*", text)})

    return sympy.expand(parse(printed) - parse(stated)) == 0


@pytest.mark.parametrize("code", PY_BLOCKS, ids=[f"python-{i}" for i in range(len(PY_BLOCKS))])
def test_python_example_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each block runs, and every `print(...)  # value` prints that value (a formula, an integer, a decimal)."""
    printed: dict[int, list[str]] = {}

    def recording_print(*args, **kwargs):
        line = sys._getframe(1).f_lineno
        printed.setdefault(line, []).append(" ".join(str(a) for a in args))
        print(*args, **kwargs)

    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__", "print": recording_print})
    assert capsys.readouterr().out.strip()
    for i, line in enumerate(code.splitlines(), 1):
        if line.startswith("print(") and "  # " in line:
            stated = _value(line.split("  # ", 1)[1])
            if stated is not None:
                assert i in printed and _same(printed[i][-1], stated), f"README: {line!r} printed {printed.get(i)}"


def test_readme_result_comments_are_all_checked() -> None:
    """The comments that state a result, across the README (the test above checks each against the output)."""
    stated = [
        _value(line.split("  # ", 1)[1])
        for block in PY_BLOCKS
        for line in block.splitlines()
        if line.startswith("print(") and "  # " in line
    ]
    values = [v for v in stated if v is not None]
    assert "16" in values and "144.0" in values and "405,853,388,800" in values
    assert "6*B*D*S*V + 72*B*D**2*L*S + 12*B*D*L*S**2" in values and len(values) >= 6
    assert _value("largest batch on one H100") is None and _value("parameter count N as a formula") is None
    assert not _same("143.9", "144.0") and _same("143.99", "144.0") and not _same("17", "16")


# the planner over 64 GPUs and the rules-of-thumb page run half a minute each: out of the default run (CI's
# slow pass runs them)
SLOW_LINES = ("symacct plan ", "symacct check")


@pytest.mark.parametrize(
    "line", [pytest.param(x, marks=pytest.mark.slow) if x.startswith(SLOW_LINES) else x for x in CLI_LINES]
)
def test_cli_example_runs(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each line through the command's entry point (``symacct.cli:main``) in this process: a new interpreter
    importing torch costs seconds a line; the installed command itself is run below."""
    from symacct.cli import main

    args = shlex.split(line)
    rc = main(args[1:])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip()


def test_the_installed_command_runs() -> None:
    """The console script pip installs (``symacct``), as a user types it."""
    import shutil

    exe = shutil.which("symacct")
    assert exe is not None, "pip install -e . puts symacct on the PATH"
    proc = subprocess.run([exe, "list"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "gpt2" in proc.stdout


def test_readme_comments_match_the_engine() -> None:
    """The numbers the README quotes in comments are what the code prints."""
    import torch

    import symacct
    from symacct.models.presets import PRESETS

    cls, make_config = PRESETS["llama3-405b"]
    with torch.device("meta"):
        model = cls(make_config())
    assert symacct.derive(model).at(B=1, S=8192).params == sum(p.numel() for p in model.parameters())
    assert "405,853,388,800" in README
    assert sum(p.numel() for p in model.parameters()) == 405_853_388_800


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    test_cmd = next(line for line in README.splitlines() if "pytest" in line and line.startswith("pip install"))
    assert test_cmd in ci.splitlines()


@pytest.mark.slow
def test_cli_output_is_byte_identical_across_hash_seeds() -> None:
    import os

    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        cmd = [sys.executable, "-m", "symacct.cli", "derive", "llama", "--config", "n_layers=2", "--json"]
        proc = subprocess.run(cmd, capture_output=True, env=env)
        assert proc.returncode == 0
        outs.append(proc.stdout)
    assert outs[0] == outs[1]
