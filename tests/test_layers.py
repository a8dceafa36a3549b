"""The package's modules form one order, each importing only modules below it: no import cycle, no
upward import (a lazy import inside a function counts too). The order is the pipeline's, and each
sub-package is one contiguous stretch of it: base modules -> trace/ -> cost/ -> memory/ -> time/ ->
accounting -> models/ -> derive (sameness, pipeline) -> measure/ -> report/ -> command line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import symacct

ROOT = Path(symacct.__file__).parent

# bottom first; a module may import only modules before it in this list (a sub-package's files are
# named package.module; cost.rules and models stand for every file under them)
ORDER = [
    "errors",
    "symbols",
    "recipes",
    "options",
    "formula",
    "trace.hooks",
    "trace.known",
    "trace.versions",
    "trace.saved",
    "trace.views",
    "trace.eager",
    "trace.loops",
    "trace.engine",
    "trace.counted",
    "trace.sdpa_choice",
    "trace.sdpa",
    "trace.record",
    "trace.probe",
    "trace.constraints",
    "trace.tensor_parallel",
    "trace.context_parallel",
    "cost.rules",
    "cost.layers",
    "cost.graph",
    "cost.experts",
    "cost.fx",
    "memory.allocator",
    "memory.static",
    "memory.liveness",
    "memory.reserved",
    "time.hardware",
    "time.model",
    "time.serving",
    "accounting",
    "models",
    "models.hf",
    "models.loading",
    "sameness",
    "memo",
    "pipeline",
    "parallel.layout",
    "parallel.schedule",
    "parallel.fsdp",
    "parallel.rank",
    "parallel.plan",
    "measure.capacity",
    "measure.run",
    "measure.verify",
    "measure.track",
    "measure.fuzz",
    "measure.parallel",
    "report.plots",
    "report.sheet",
    "report.summary",
    "report.terminal",
    "report.check",
    "report.parallel",
    "report.reference",
    "cli",
]
RANK = {name: i for i, name in enumerate(ORDER)}


def stage_of(module: str) -> str:
    """The ORDER entry a dotted module (relative to symacct) belongs to: the longest entry it starts with;
    a sub-package's own __init__ (``cost``) stands with its lowest entry."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    below = [e for e in ORDER if e.startswith(module + ".")]
    if below:
        return below[0]
    raise AssertionError(f"symacct.{module} is in no stage: add it to ORDER")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """Modules of symacct a file imports, anywhere in it (functions included), TYPE_CHECKING blocks excepted."""
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
            # from symacct.report import sheet: the module report.sheet; from symacct.cost.graph import Node: cost.graph
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.append(sub if sub.startswith("symacct.") and _exists(sub[len("symacct.") :]) else node.module)
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "symacct":
                out.add("")
            elif name.startswith("symacct."):
                out.add(name[len("symacct.") :])
    return out


def test_every_module_is_in_the_order():
    for path in ROOT.rglob("*.py"):
        if _module(path) not in ("", "__main__"):
            stage_of(_module(path))


def test_each_sub_package_is_one_stretch_of_the_order():
    packages = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()]
    assert set(packages) >= {"trace", "cost", "memory", "time", "measure", "report", "models"}
    for pkg in packages:
        at = [i for i, e in enumerate(ORDER) if e == pkg or e.startswith(pkg + ".")]
        assert at == list(range(at[0], at[-1] + 1)), f"{pkg}/ is split in ORDER"
        init = ast.parse((ROOT / pkg / "__init__.py").read_text())
        assert ast.get_docstring(init), f"{pkg}/__init__.py: say what the sub-package holds"


def test_no_module_imports_upward():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module(path)
        if module in ("", "__main__"):
            continue
        stage = stage_of(module)
        for dep in sorted(_imports(path)):
            if dep == "":
                wrong.append(f"{path.relative_to(ROOT.parent)} imports the package symacct (import the module)")
            elif RANK[stage_of(dep)] > RANK[stage]:
                wrong.append(f"{path.relative_to(ROOT.parent)} imports {dep}")
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


def test_each_stage_imports_without_the_ones_above_it():
    """Importing a module loads no module above it (the package's and sub-packages' __init__ load nothing
    eagerly); each import in a fresh interpreter state."""
    code = (
        "import sys, importlib, json\n"
        f"order = {ORDER!r}\n"
        "loaded = {}\n"
        "for stage in order:\n"
        "    for m in [m for m in sys.modules if m.startswith('symacct')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module('symacct.' + stage)\n"
        "    loaded[stage] = sorted(m[len('symacct.'):] for m in sys.modules if m.startswith('symacct.'))\n"
        "print(json.dumps(loaded))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    above = {stage: [m for m in modules if RANK[stage_of(m)] > RANK[stage]] for stage, modules in loaded.items()}
    assert not any(above.values()), {k: v for k, v in above.items() if v}
