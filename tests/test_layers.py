"""The package's modules form one order, each importing only modules below it: no import cycle, no
upward import (a lazy import inside a function counts too). The order is the pipeline's:
trace -> rules -> graph -> memory -> accounting -> derive -> time, reports -> command line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import symacct

ROOT = Path(symacct.__file__).parent

# bottom first; a module may import only modules before it in this list
ORDER = [
    "errors",
    "symbols",
    "recipes",
    "options",
    "hardware",
    "trace",
    "probe",
    "constraints",
    "rules",
    "layers",
    "graph",
    "memory",
    "experts",
    "formula",
    "timing",
    "accounting",
    "models",
    "hf",
    "sameness",
    "pipeline",
    "measure",
    "plots",
    "sheet",
    "report",
    "terminal",
    "verify",
    "track",
    "fuzz",
    "check",
    "loading",
    "reference",
    "cli",
]


def _stage(path: Path) -> str:
    """The stage a file belongs to: its top-level module or sub-package under symacct/."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """Stages a file imports from, anywhere in it (functions included), TYPE_CHECKING blocks excepted."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # from symacct import sheet: the module sheet; from symacct.sheet import build: sheet
            names = [f"symacct.{a.name}" for a in node.names] if node.module == "symacct" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "symacct":
                out.add(parts[1] if len(parts) > 1 else "symacct")
    return out


def test_every_stage_is_in_the_order():
    stages = {_stage(p) for p in ROOT.rglob("*.py")} - {"__init__", "__main__"}
    assert stages <= set(ORDER), f"add {sorted(stages - set(ORDER))} to ORDER"


def test_no_module_imports_upward():
    rank = {name: i for i, name in enumerate(ORDER)}
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        stage = _stage(path)
        if stage in ("__init__", "__main__"):
            continue
        for dep in sorted(_imports(path)):
            if dep == stage:
                continue
            if dep == "symacct" or rank.get(dep, len(ORDER)) > rank[stage]:
                wrong.append(f"{path.relative_to(ROOT.parent)} imports " + ("symacct" if dep == "symacct" else dep))
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


def test_each_stage_imports_without_the_ones_above_it():
    """Importing a stage loads no stage above it (the package's own __init__ loads nothing eagerly)."""
    code = (
        "import sys, importlib\n"
        f"order = {ORDER!r}\n"
        "for i, stage in enumerate(order):\n"
        "    for m in [m for m in sys.modules if m.startswith('symacct')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module('symacct.' + stage)\n"
        "    above = sorted({m.split('.')[1] for m in sys.modules if m.startswith('symacct.')} & set(order[i + 1:]))\n"
        "    assert not above, (stage, above)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
