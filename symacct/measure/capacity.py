"""Whether a real run fits this machine, asked before it starts: ``symacct verify`` builds the model at its
real size and runs its step, and a size the machine cannot hold ends in the kernel's out-of-memory killer
(the process gone, no message: ``symacct verify llama``, Llama 2 7B with AdamW in fp32, is about 112 GB).
The derivation knows the step's peak before anything is allocated, so the run is refused when that peak
cannot fit, with both figures and what to change.

Available memory:

- host (``cpu``): ``MemAvailable`` of ``/proc/meminfo`` (the kernel's estimate of what can be allocated
  without swapping: free memory plus reclaimable page cache), capped by the process's cgroup limit less its
  usage (v2 ``memory.max`` / ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``;
  the usage less its inactive file cache, which the kernel reclaims first, as container runtimes count it);
  elsewhere ``os.sysconf``'s available pages; unknown: no check.
- ``cuda``: ``torch.cuda.mem_get_info``'s free bytes on that device.

The derived peak is what the step itself holds; the measuring process adds its own (the interpreter, torch,
the trackers), so a refusal is certain and a pass is not a promise: the check says "at least".
"""

from __future__ import annotations

import os
from pathlib import Path

from symacct.errors import SymacctError

RUN_SMALLER = (
    "verify runs the step for real at these sizes: choose smaller ones (--config FIELD=VALUE for the model's "
    "widths and layers, --batch, --seq), or derive the figures without a run (symacct derive, symacct fit)"
)
_UNLIMITED = 1 << 60  # a cgroup limit at or above this is "no limit" (v1 writes 2**63 rounded to a page)


def _meminfo(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_room(root: Path) -> int | None:
    """Bytes the process's memory cgroup still allows (None: no limit, or no cgroup file to read)."""
    v2 = (root / "memory.max", root / "memory.current", root / "memory.stat", "inactive_file")
    v1 = (
        root / "memory" / "memory.limit_in_bytes",
        root / "memory" / "memory.usage_in_bytes",
        root / "memory" / "memory.stat",
        "total_inactive_file",
    )
    for limit_path, usage_path, stat, key in (v2, v1):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        return max(0, limit - max(0, usage - _inactive_file(stat, key)))
    return None


def host_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process can still allocate on the host (module docstring); None when unknown."""
    found = _meminfo(proc / "meminfo")
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            found = None
    room = _cgroup_room(cgroup)
    if room is None:
        return found
    return room if found is None else min(found, room)


def available(device: str) -> int | None:
    """Bytes free on ``device`` (``cpu``, ``cuda``, ``cuda:N``) for a run to allocate; None when unknown."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return host_available()


def _gb(n: int) -> str:
    return f"{n / 1e12:.3g} TB" if n >= 1e12 else f"{n / 1e9:.3g} GB"


def require(need: int, device: str, what: str, hint: str, free: int | None = None) -> None:
    """Refuse a real run that needs at least ``need`` bytes on ``device`` where fewer are free (``free``:
    that figure, else ``available(device)``; unknown: no check)."""
    free = available(device) if free is None else free
    if free is None or need <= free:
        return
    where = f"this machine has {_gb(free)} of memory available" if device == "cpu" else f"{device} has {_gb(free)} free"
    raise SymacctError(f"{what} needs at least {_gb(need)} (derived); {where}", hint=hint)
