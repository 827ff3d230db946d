#!/usr/bin/env bash
# Prepare llama-cpp-python as a benchmark peer, in a venv of its own (bench/peers/.venv-llama-cpp).
# It is what a CPU user would pick instead of Tandem: llama.cpp on the shipped Q4_1 GGUF file.
# The benchmarks use it when it exists and skip it (saying so) when it does not.
#   - PyPI has only the source: pip compiles llama.cpp with CMake (about 4.5 minutes on 2 cores),
#     for this CPU (GGML_NATIVE, llama.cpp's default), CPU backend only;
#   - nothing else from Tandem's venv is needed: the peer reads the GGUF file itself.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv-llama-cpp
VERSION=0.3.36
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python peer ready in bench/peers/$VENV"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \
    "$VENV/bin/python" -m pip install --progress-bar off --no-cache-dir "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in bench/peers/$VENV')"
