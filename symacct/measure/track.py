"""Resource logs of real runs, and the diff of two runs (the seed's OOM post-mortem).

``with symacct.track("run-a", path="run-a.jsonl", model=model, acct=acct, sizes={...}) as t:``
records, at each ``t.mark("after_forward")``, the allocated bytes, the
reserved bytes (CUDA) and the peak since the previous mark, next to the
predicted value of that phase point when an accounting is given. The first
line of the log is a header: the run's name, the model, its config, the
sizes, and the predicted breakdown (params, grads, optimizer, activations
per module). Each later line is one mark. Lines are JSON objects (JSON lines).

On CPU the live bytes come from ``symacct.measure.run.StorageTracker``; on CUDA
from ``torch.cuda.memory_allocated`` / ``memory_reserved`` /
``max_memory_allocated`` (the peak is reset at every mark).

``diff(a, b)`` compares two logs phase by phase and names the phase, the
memory part (params, grads, optimizer, activations) and the module whose
bytes changed most.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from symacct.accounting import Accounting
from symacct.errors import SymacctError
from symacct.measure.run import StorageTracker

_PHASES = ("after_forward", "after_backward", "after_optimizer")


class Tracker:
    def __init__(self, name: str, device: str, predicted: dict[str, Any] | None) -> None:
        self.name = name
        self.device = device
        self.predicted = predicted or {}
        self.records: list[dict[str, Any]] = []
        self._storage: StorageTracker | None = None

    def mark(self, phase: str) -> dict[str, Any]:
        """Record allocated / reserved / peak now (peak since the previous mark)."""
        if self.device.startswith("cuda"):
            rec = {
                "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved(),
                "peak": torch.cuda.max_memory_allocated(),
            }
            torch.cuda.reset_peak_memory_stats()
        else:
            assert self._storage is not None
            rec = {"allocated": self._storage.current(), "reserved": None, "peak": self._storage.peak}
            self._storage.peak = rec["allocated"]
        rec = {"run": self.name, "phase": phase, **rec}
        if phase in self.predicted.get("phases", {}):
            rec["predicted"] = self.predicted["phases"][phase]
        self.records.append(rec)
        return rec


def _predicted(acct: Accounting | None, sizes: dict[str, int]) -> dict[str, Any] | None:
    if acct is None:
        return None
    at = acct.at(**sizes)
    mem = at.memory
    return {
        "phases": {p: int(getattr(mem, p)) for p in _PHASES} | {"peak": int(mem.peak)},
        "parts": {
            "params": int(mem.params),
            "grads": int(mem.grads),
            "optimizer": int(mem.optimizer),
            "activations": int(mem.activations),
        },  # fmt: skip
        "activations_by_module": {k: int(v) for k, v in mem.activations_by_module.items()},
    }


@contextmanager
def track(
    name: str,
    path: str | Path,
    *,
    model: nn.Module,
    args: tuple[Any, ...] = (),
    acct: Accounting | None = None,
    sizes: dict[str, int] | None = None,
    device: str = "cpu",
) -> Iterator[Tracker]:
    """Track a real run; the log is written when the block ends (nothing half-way on an error).

    The path is checked for writing before the run starts: a run is never
    spent only to fail at the end.
    """
    sizes = dict(sizes or {})
    _check_writable(Path(path))
    config = getattr(model, "config", None)
    header = {
        "run": name,
        "header": True,
        "model": type(model).__name__,
        "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {},
        "sizes": sizes,
        "device": device,
        "predicted": _predicted(acct, sizes),
    }
    t = Tracker(name, device, header["predicted"])
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SymacctError("device cuda but CUDA is not available here", hint="track on device='cpu'")
        torch.cuda.reset_peak_memory_stats()
        yield t
    else:
        initial = [*model.parameters(), *model.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
        t._storage = StorageTracker(initial)
        with t._storage:
            yield t
    lines = [json.dumps(header, sort_keys=True)] + [json.dumps(r, sort_keys=True) for r in t.records]
    Path(path).write_text("\n".join(lines) + "\n")


def _check_writable(path: Path) -> None:
    """Refuse a log path that cannot be written, without leaving a file behind."""
    existed = path.exists()
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        with open(path, "a"):
            pass
    except OSError as e:
        raise SymacctError(
            f"cannot write the log {str(path)!r}: {e.strerror or e}", hint="choose a path in a writable folder"
        ) from e
    if not existed:
        path.unlink()


_HEADER = {"run": str, "model": str}
_MARK = {"phase": str, "allocated": int, "peak": int}


def _fields(row: dict[str, Any], want: dict[str, type], where: str) -> None:
    for key, kind in want.items():
        v = row.get(key)
        if v is None:
            raise SymacctError(f"{where} has no {key!r}", hint="a log is JSON lines written by track()")
        if not isinstance(v, kind) or isinstance(v, bool):
            raise SymacctError(
                f"{where}: {key!r} is {type(v).__name__} {v!r}, not {kind.__name__}",
                hint="a log is JSON lines written by track()",
            )


def _predicted_ok(pred: Any, where: str) -> None:
    if pred is None:
        return
    ok = isinstance(pred, dict) and all(isinstance(pred.get(k), dict) for k in ("phases", "parts"))
    ok = ok and isinstance(pred.get("activations_by_module", {}), dict)
    ok = ok and all(isinstance(v, int) for part in ("phases", "parts") for v in pred[part].values())
    if not ok:
        raise SymacctError(
            f"{where}: 'predicted' lacks its phases, parts or activations_by_module (or holds non-integers)",
            hint="a log is JSON lines written by track()",
        )


def read_log(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, marks) of a log; a one-line SymacctError for anything that is not a symacct log."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SymacctError(
            f"{path}: not UTF-8 text (byte {e.start})", hint="a log is JSON lines written by track()"
        ) from e
    except OSError as e:
        raise SymacctError(f"cannot read log {str(path)!r}: {e.strerror}", hint="pass a log written by track()") from e
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SymacctError(f"{path}: line {i} is not JSON", hint="a log is JSON lines written by track()") from e
    if not rows or not isinstance(rows[0], dict) or not rows[0].get("header"):
        raise SymacctError(f"{path}: no symacct header line", hint="a log is JSON lines written by track()")
    _fields(rows[0], _HEADER, f"{path}: the header")
    _predicted_ok(rows[0].get("predicted"), f"{path}: the header")
    for i, row in enumerate(rows[1:], 2):
        if not isinstance(row, dict):
            raise SymacctError(f"{path}: line {i} is not an object", hint="a log is JSON lines written by track()")
        _fields(row, _MARK, f"{path}: line {i}")
    return rows[0], rows[1:]


def diff(path_a: str | Path, path_b: str | Path) -> dict[str, Any]:
    """Phase-by-phase comparison of two logs of the same model; names what changed most."""
    ha, ma = read_log(path_a)
    hb, mb = read_log(path_b)
    if ha["model"] != hb["model"]:
        raise SymacctError(
            f"the logs are of different models ({ha['model']} vs {hb['model']})",
            hint="diff compares two runs of one model",
        )
    by_a = {r["phase"]: r for r in ma}
    by_b = {r["phase"]: r for r in mb}
    phases = []
    for p in [r["phase"] for r in ma if r["phase"] in by_b]:
        a, b = by_a[p], by_b[p]
        phases.append({"phase": p, "allocated_a": a["allocated"], "allocated_b": b["allocated"],
                       "delta": b["allocated"] - a["allocated"], "peak_delta": b["peak"] - a["peak"]})  # fmt: skip
    out: dict[str, Any] = {"runs": [ha["run"], hb["run"]], "phases": phases}
    if phases:
        worst = max(phases, key=lambda r: abs(r["peak_delta"]) + abs(r["delta"]))
        out["phase_changed_most"] = worst["phase"]
    pa, pb = ha.get("predicted") or {}, hb.get("predicted") or {}
    if pa and pb:
        keys = sorted(set(pa["parts"]) | set(pb["parts"]))
        parts = {k: pb["parts"].get(k, 0) - pa["parts"].get(k, 0) for k in keys}
        out["parts_delta"] = parts
        out["part_changed_most"] = max(parts, key=lambda k: abs(parts[k]))
        mods = set(pa["activations_by_module"]) | set(pb["activations_by_module"])
        mdelta = {m: pb["activations_by_module"].get(m, 0) - pa["activations_by_module"].get(m, 0) for m in mods}
        if mdelta:
            out["module_changed_most"] = max(sorted(mdelta), key=lambda m: abs(mdelta[m]))
    return out
