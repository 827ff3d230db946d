"""The cross-service suites' fixtures: the units' shared ones, imported (common/tests/fixtures.py and
the decoder's tiny_fp32), so each is defined once."""

from __future__ import annotations

import importlib.util

from common.tests.fixtures import (  # noqa: F401  (fixtures, by name)
    environ,
    grpc_verbosity_kept,  # noqa: F401  (autouse: every test)
    smollm2_dir,
    tiny_model_dir,
)
from services.decoder.tests.fixtures import tiny_fp32  # noqa: F401

# The Neuron backend's tests (tests/xla/) need torch_xla, which only .venv-xla has: `make test` runs
# them there, after the rest of the suite here.
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]
