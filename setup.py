"""Builds the CPU kernels when the workspace is installed (pip install, editable or not; the image build).

The build itself is the decoder unit's (services/decoder/kernel_setup.py, which its own setup.py uses
too): one optional extension per ISA level, compiled in place under services/decoder/.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

# Loaded by path: it is no module of the package (see its docstring).
ROOT = Path(__file__).resolve().parent
_SPEC = importlib.util.spec_from_file_location(
    "tandem_kernel_setup", ROOT / "services/decoder/kernel_setup.py"
)
kernel_setup = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(kernel_setup)

setup(**kernel_setup.kernel_setup_arguments(ROOT))
