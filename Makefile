# Every target that needs Python depends on .venv, so a fresh clone needs only `make demo` or `make test`.
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: setup test protos lint demo bench soak

setup: $(VENV)/.installed

# torch goes in first and pinned: any other torch request makes pip fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off torch==$(TORCH_VERSION)
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	touch $@

# Both services on the embedded default model (created on first use), one streamed generation.
demo: setup
	$(PY) -m services.demo

test: setup
	$(PY) -m pytest -q

protos: setup
	$(PY) -m common.pb.generate

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every workload and peer in one run; JSON and PNG land in bench/results/ (bench/README.md).
bench: setup
	$(PY) bench/harness.py

# The reliability suites, longer: more fuzz examples and more concurrent streams than `make test`.
soak: setup
	TANDEM_FUZZ_EXAMPLES=20000 TANDEM_LOAD_STREAMS=1000 $(PY) -m pytest -q tests/integration/reliability
