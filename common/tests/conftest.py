"""The contract's tests use the shared fixtures (common/tests/fixtures.py) by importing them here."""

from common.tests.fixtures import environ, tiny_model_dir  # noqa: F401  (fixtures, found by name)
