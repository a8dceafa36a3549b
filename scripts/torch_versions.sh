#!/usr/bin/env bash
# Runs the whole test suite on every torch version pyproject.toml admits, each in its own
# virtual environment (kept under $VENVS for the next run). On demand, not in CI:
# 2.13.0 and 2.14.1 come from these machines' disk; 2.11.0 (the GPU machines' version) is a
# CUDA build from PyPI, about 3 GB with its NVIDIA wheels, and runs on the CPU here.
# Usage: bash scripts/torch_versions.sh            (VERSIONS="2.11.0" to pick)
set -uo pipefail
cd "$(dirname "$0")/.."
venvs="${VENVS:-/tmp/symacct-torch}"
status=0
for v in ${VERSIONS:-2.11.0 2.13.0 2.14.1}; do
  venv="$venvs/$v"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch==$v" -e ".[test]" >/dev/null 2>&1 || { echo "torch $v: install failed"; status=1; continue; }
  got="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  result="$("$venv/bin/python" -m pytest -q -p no:cacheprovider 2>&1 | tail -1)" || status=1
  echo "torch $got: $result"
done
exit $status
