#!/usr/bin/env bash
# On a machine with a CUDA GPU and PyTorch already installed (no network needed):
# runs the CUDA tests and `symacct verify --device cuda` for the reference models at two
# sizes, and writes one report file. Usage: bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs}"
mkdir -p "$out"
report="$out/gpu-report.md"
{
  echo "# GPU check"
  echo
  echo "- date: $(date -u +%F)"
  python -c "import torch; print('- torch', torch.__version__, '| device', torch.cuda.get_device_name(0))"
  echo
  echo '## CUDA tests'
  echo '```'
  timeout 240 python -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tail -15
  echo '```'
  for spec in \
    "gpt2 --config n_layer=4 --config n_embd=256 --config n_head=4 --batch 8 --seq 256" \
    "gpt2 --config n_layer=12 --config n_embd=768 --config n_head=12 --batch 8 --seq 1024 --autocast bf16" \
    "llama --config n_layers=4 --config dim=512 --config n_heads=8 --config n_kv_heads=2 --config hidden_dim=1376 --config vocab_size=32000 --config max_seq_len=512 --config sdpa=true --batch 4 --seq 512 --autocast bf16"; do
    echo
    echo "## symacct verify $spec --device cuda --steps 3"
    echo '```'
    # shellcheck disable=SC2086
    timeout 120 python -m symacct.cli verify $spec --device cuda --steps 3 2>&1 | tail -25
    echo '```'
  done
} > "$report"
echo "wrote $report"
