"""Builds the CPU kernels when the decoder unit is installed (`pip install -e ./common -e
./services/decoder`): kernel_setup.py, the build the workspace's setup.py uses too."""

import importlib.util
from pathlib import Path

from setuptools import setup

# Loaded by path: it is no module of the package (see its docstring).
HERE = Path(__file__).resolve().parent
_SPEC = importlib.util.spec_from_file_location("tandem_kernel_setup", HERE / "kernel_setup.py")
kernel_setup = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(kernel_setup)

setup(**kernel_setup.kernel_setup_arguments(HERE))
