#!/usr/bin/env bash
# On a machine with a CUDA GPU and PyTorch already installed (no network needed):
# runs symacct from this checkout (nothing installed or fetched), runs the CUDA tests and
# `symacct verify --device cuda` for the reference models at three sizes, and writes one
# report file. Ends within about 8 minutes (each part has its own timeout).
# The verify runs predict as a machine without a GPU would (--predict no-gpu), so the first GPU run checks
# the figures people plan with before they have one.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]      (report: OUT_DIR/gpu-report.md, default docs/)
# Without a GPU it still runs: the CUDA tests skip and each verify says CUDA is not available.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
out="${1:-docs}"
mkdir -p "$out"
report="$(cd "$out" && pwd)/gpu-report.md"
# runs from the checkout itself (python puts the working directory first on its path): nothing is
# fetched or built, nothing installed
py="${PYTHON:-python3}"
start=$(date +%s)
{
  echo "# GPU check"
  echo
  echo "Written by \`scripts/gpu_check.sh\`; each block is the tail of one command's output. The predicted"
  echo "side of each verify is the no-GPU prediction for this GPU (\`--predict no-gpu\`: symacct's backward"
  echo "engine, SDPA chosen by symacct's reading of PyTorch's rules), judged at 3 % (allocated), 5 % (reserved)"
  echo "and 25 % (step time against the roofline)."
  echo
  echo "- date: $(date -u +%F)"
  "$py" -c "import torch, symacct.models; print('- torch', torch.__version__, '| CUDA', torch.version.cuda, '| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>&1
  # the CUDA context of a fresh process (the catalog's cuda_context is a published figure for another GPU):
  # device memory in use after one small tensor, less what the caching allocator reserved for it
  "$py" -c "import torch
if torch.cuda.is_available():
    x = torch.ones(1, device='cuda'); free, total = torch.cuda.mem_get_info()
    print('- CUDA context at start:', total - free - torch.cuda.memory_reserved(), 'bytes (in use, less reserved)')
    print('- device memory total:', total, 'bytes (torch.cuda.mem_get_info; the catalog takes the nominal GB as 1e9 bytes)')" 2>&1
  echo
  echo '## CUDA tests'
  echo '```'
  timeout 200 "$py" -m pytest -q -p no:cacheprovider --rootdir "$repo" -m cuda "$repo/tests/test_cuda.py" "$repo/tests/test_engine.py" 2>&1 | tail -15
  echo '```'
  for spec in \
    "gpt2 --config n_layer=4 --config n_embd=256 --config n_head=4 --batch 8 --seq 256" \
    "gpt2 --config n_layer=12 --config n_embd=768 --config n_head=12 --batch 8 --seq 1024 --autocast bf16" \
    "llama --config n_layers=4 --config dim=512 --config n_heads=8 --config n_kv_heads=2 --config hidden_dim=1376 --config vocab_size=32000 --config max_seq_len=512 --config sdpa=true --batch 4 --seq 512 --autocast bf16"; do
    echo
    echo "## symacct verify $spec --device cuda --steps 3 --predict no-gpu"
    echo '```'
    # shellcheck disable=SC2086
    timeout 90 "$py" -m symacct.cli verify $spec --device cuda --steps 3 --predict no-gpu 2>&1 | tail -28
    echo "exit code: ${PIPESTATUS[0]}"
    echo '```'
  done
  echo
  echo "- took $(($(date +%s) - start)) s"
} > "$report"
echo "wrote $report"
