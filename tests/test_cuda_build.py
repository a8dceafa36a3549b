"""The CUDA-semantics tests under the CUDA build of torch, from the CPU build's suite (issue 15's second
environment): ``scripts/cuda_build_tests.sh`` makes the environment once (torch 2.14.1 from the
machine's disk) and runs ``tests/test_cuda_semantics.py`` and ``tests/test_engine.py`` there."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cuda_build_tests.sh"


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is not None, reason="this environment is a CUDA build: the tests run here")
def test_the_cuda_semantics_tests_pass_under_the_cuda_build() -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "-rs"], capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    if proc.returncode == 3:
        pytest.skip(f"no CUDA build of torch could be installed here: {out.strip()[-300:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "CUDA build 1" in out and " passed" in out.splitlines()[-1], out[-1000:]
    # what may skip there: the CPU build's refusal and the tests that need a GPU, none of the CUDA semantics
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skipped if "test_cuda_semantics" in line], skipped
