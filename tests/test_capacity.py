"""A real run that cannot fit is refused before it starts (``symacct.measure.capacity``): the free memory
read from the kernel's and the cgroup's own files, the need from the derivation, and a rank the kernel
kills named as such."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cli_run import cli
from parallel_cases import GPT2_SMALL, Batch, CrashOnRank, KilledOnRank, adamw

import symacct
from symacct.errors import SymacctError
from symacct.measure import capacity
from symacct.measure.capacity import host_available, require
from symacct.models.gpt2 import GPT2
from symacct.parallel.layout import make_layout
from symacct.parallel.rank import derive_parallel

GIB = 1 << 30


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MEMINFO = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def test_memavailable_is_read_in_kib(tmp_path):
    proc = _files(tmp_path / "proc", {"meminfo": MEMINFO})
    assert host_available(proc, tmp_path / "no-cgroup") == 20_000_000 * 1024


@pytest.mark.parametrize(
    ("cgroup", "room"),
    [
        # v2: the limit less the usage, the usage less its inactive file cache (reclaimed first)
        (
            {
                "memory.max": "8589934592\n",
                "memory.current": "3221225472\n",
                "memory.stat": "anon 1\ninactive_file 1073741824\n",
            },
            6 * GIB,
        ),  # noqa: E501
        ({"memory.max": "max\n", "memory.current": "3221225472\n"}, None),  # no limit: MemAvailable
        # v1: its files under memory/, "no limit" written as a number near 2**63
        (
            {
                "memory/memory.limit_in_bytes": "4294967296\n",
                "memory/memory.usage_in_bytes": "1073741824\n",
                "memory/memory.stat": "total_inactive_file 0\n",
            },
            3 * GIB,
        ),  # noqa: E501
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"}, None),
        ({"memory.max": "1073741824\n", "memory.current": "2147483648\n"}, 0),  # over its limit: nothing left
    ],
)
def test_a_cgroup_limit_caps_what_is_available(tmp_path, cgroup, room):
    proc = _files(tmp_path / "proc", {"meminfo": MEMINFO})
    got = host_available(proc, _files(tmp_path / "cg", cgroup))
    assert got == (20_000_000 * 1024 if room is None else room)


def test_require_says_both_figures_and_passes_what_fits():
    with pytest.raises(SymacctError, match=r"needs at least 3 GB \(derived\); this machine has 2 GB"):
        require(3 * 10**9, "cpu", "the run", "smaller", free=2 * 10**9)
    require(2 * 10**9, "cpu", "the run", "smaller", free=2 * 10**9)  # exactly what is free: not refused
    with pytest.raises(SymacctError, match=r"at least 6\.6 TB"):
        require(66 * 10**11, "cpu", "the run", "smaller", free=10**9)


def _small() -> tuple[GPT2, symacct.Accounting]:
    torch.manual_seed(0)
    model = GPT2(GPT2_SMALL)
    return model, symacct.derive(model, optimizer="adamw")


class _Ran(Exception):
    """The real run was reached."""


def _reached(*args: object, **kwargs: object) -> None:
    raise _Ran


def test_verify_refuses_before_running_what_cannot_fit(monkeypatch):
    from symacct.measure.verify import verify

    model, acct = _small()
    at = acct.at(B=2, S=16)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    need = int(at.memory.peak) - held  # the model is built (parameters, buffers): the rest of the step's peak
    monkeypatch.setattr("symacct.measure.verify.measure_memory_steps", _reached)
    monkeypatch.setattr(capacity, "host_available", lambda: need - 1)
    with pytest.raises(SymacctError, match="the real run of GPT2 at B=2, S=16 .1 step. needs at least"):
        verify(model, acct, B=2, S=16, optimizer=adamw)  # refused before the step
    monkeypatch.setattr(capacity, "host_available", lambda: need)
    with pytest.raises(_Ran):  # exactly enough: it runs
        verify(model, acct, B=2, S=16, optimizer=adamw)


def test_verify_parallel_refuses_before_spawning(monkeypatch):
    from symacct.measure import parallel

    model, acct = _small()
    whole = acct.at(B=2, S=16).memory
    monkeypatch.setattr(parallel, "gloo_world", _reached)
    lay = make_layout(dp=2, dp_mode="ddp")
    each = int(whole.params + whole.buffers)  # two processes, each building the whole model
    monkeypatch.setattr(capacity, "host_available", lambda: 2 * each - 1)
    with pytest.raises(SymacctError, match=r"dp=2 .* 2 processes\) needs at least"):
        parallel.verify_parallel(model, lay, 2, 16)
    peaks = sum(int(r.peak) for r in derive_parallel(acct, lay).at(B=2, S=16).ranks)
    monkeypatch.setattr(capacity, "host_available", lambda: max(2 * each, peaks))
    with pytest.raises(_Ran):
        parallel.verify_parallel(model, lay, 2, 16)


def test_cli_verify_of_a_model_no_machine_holds_is_one_line():
    # GPT-2 of width 2**17: 12 D^2 L = 4e11 parameters, with AdamW's states about 6.6 TB
    cfg = ["n_layer=2", "n_head=2", "n_embd=131072", "vocab_size=64", "block_size=16"]
    out = cli("verify", "gpt2", *(a for c in cfg for a in ("--config", c)))
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1
    got = re.search(r"needs at least ([0-9.]+) TB \(derived\)", out.stderr)
    assert got and "--config" in out.stderr, out.stderr
    # at least the textbook's 16 bytes a parameter (weights, gradients, AdamW's two states) of 12 D^2 L
    assert float(got.group(1)) * 1e12 >= 16 * 12 * 131072**2 * 2 * 0.999  # (.3g rounding)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named():
    from symacct.measure.parallel import gloo_world

    with pytest.raises(SymacctError, match="rank 1 ended by SIGKILL .*out-of-memory killer") as e:
        gloo_world(KilledOnRank(GPT2_SMALL, 1), make_layout(dp=2, dp_mode="ddp"), Batch(2, 8, 37), adamw)
    assert e.value.__cause__ is not None  # the spawn's own exception kept as the cause


@pytest.mark.slow
def test_a_native_crash_runs_the_world_once_more(tmp_path):
    """A rank that aborts (SIGABRT) in the first world only: the world runs again, with a warning naming
    the rank and the signal, and its figures are those of a world that never crashed; a rank that aborts in
    every world fails as before, the second crash the error, the spawn's exception its cause."""
    from symacct.measure.parallel import gloo_world

    lay = make_layout(dp=2, dp_mode="ddp")
    clean = gloo_world(CrashOnRank(GPT2_SMALL, 1, str(tmp_path), times=0), lay, Batch(2, 8, 37), adamw)
    (tmp_path / "once").mkdir()
    with pytest.warns(RuntimeWarning, match="rank 1 ended by SIGABRT: run once more"):
        got = gloo_world(CrashOnRank(GPT2_SMALL, 1, str(tmp_path / "once")), lay, Batch(2, 8, 37), adamw)
    assert [(g.params, g.grads, g.optimizer, g.collectives, g.loss, g.peak) for g in got] == [
        (g.params, g.grads, g.optimizer, g.collectives, g.loss, g.peak) for g in clean
    ]
    (tmp_path / "always").mkdir()
    with pytest.warns(RuntimeWarning), pytest.raises(SymacctError, match="rank 1 ended by SIGABRT") as e:
        gloo_world(CrashOnRank(GPT2_SMALL, 1, str(tmp_path / "always"), times=2), lay, Batch(2, 8, 37), adamw)
    assert e.value.__cause__ is not None and len(list((tmp_path / "always").iterdir())) == 2
