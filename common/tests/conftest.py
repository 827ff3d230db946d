"""The contract's tests use the shared fixtures (common/tests/fixtures.py) by importing them here."""

from common.tests.fixtures import (  # noqa: F401  (fixtures, found by name)
    environ,
    grpc_verbosity_kept,  # noqa: F401  (autouse: every test)
    tiny_model_dir,
)
