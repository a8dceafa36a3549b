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


@pytest.mark.parametrize("code", PY_BLOCKS, ids=[f"python-{i}" for i in range(len(PY_BLOCKS))])
def test_python_example_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("line", CLI_LINES)
def test_cli_example_runs(line: str) -> None:
    args = shlex.split(line)
    proc = subprocess.run([sys.executable, "-m", "symacct.cli", *args[1:]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


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
