#!/usr/bin/env bash
# The CUDA-semantics tests, in a second environment with the CUDA build of torch (no GPU needed): CI
# runs this through tests/test_cuda_build.py; the default suite runs on the CPU build, where these
# tests skip. The environment is made once (torch 2.14.1 from these machines' disk, about 90 s and
# 5.5 GB) under $SYMACCT_CUDA_VENV and reused; it sees the CPU environment's other packages.
# Exit codes: 0 the tests passed, 1 a test failed, 3 the environment could not be made.
# Usage: bash scripts/cuda_build_tests.sh [pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${SYMACCT_CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/symacct/cuda-build}"
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
  python3 -m venv --system-site-packages "$venv" || exit 3
  "$venv/bin/python" -m pip install -q "torch==2.14.1" >"$venv.log" 2>&1 || { tail -3 "$venv.log"; exit 3; }
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, '| CUDA build', torch.version.cuda, '| GPU', torch.cuda.is_available())" 2>/dev/null
PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_cuda_semantics.py tests/test_engine.py "$@" || exit 1
