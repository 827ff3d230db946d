#!/usr/bin/env bash
# Device check: on a machine with an NVIDIA GPU, run the GPU-marked tests and the decode benchmark
# (bench-small and a Qwen3-0.6B-shaped random model; eager and compiled; tokens/s at 1/8/32, TTFT
# for a 2k-token prompt, float32 parity against the CPU) and print one table.
# Usage: scripts/device_check.sh [python]   (default: .venv/bin/python, needs a CUDA build of torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"device_check: torch {torch.__version__} sees no CUDA device; run this on a GPU machine "
             "with a CUDA build of torch")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PYEOF

echo "== GPU-marked tests"
"$PY" -m pytest -q -m gpu tests/gpu

echo "== decode benchmark"
"$PY" scripts/device_bench.py --device cuda --shapes bench-small,qwen3-0.6b --sizes 1,8,32 --ttft-prompt-len 2048
