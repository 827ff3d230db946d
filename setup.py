"""Builds the CPU kernels when the project is installed (pip install, editable or not; the image build).

One shared library per ISA level this machine's architecture has (tandem/decoder/backends/cpu/
build.py), each an optional extension: without a C compiler, or if a level fails to build, pip says
so and the install goes on; the decoder then logs one line and runs on torch ops. The libraries are
plain C loaded with ctypes, not Python modules: the compile command is build.py's own, the one the
tests run with -Werror.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Loaded by path: importing the package would run tandem/__init__.py in pip's isolated build
# environment, which has no torch (build.py needs only the standard library).
ROOT = Path(__file__).resolve().parent
_SPEC = importlib.util.spec_from_file_location(
    "tandem_kernel_build", ROOT / "tandem/decoder/backends/cpu/build.py"
)
build = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)  # dataclasses look it up
_SPEC.loader.exec_module(build)


class BuildKernels(build_ext):
    """Each level with build.py's command (and CC, when set), written where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        levels = build.this_machine_levels()
        level = next(level for level in levels if ext.name.endswith(build.module_name(level)))
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        build.compile_level(os.environ.get("CC") or "cc", level, output)


setup(
    ext_modules=[
        Extension(
            f"{build.PACKAGE}.{build.module_name(level)}",
            sources=[str(build.CSRC.relative_to(ROOT) / source) for source in build.SOURCES],
            optional=True,
        )
        for level in build.this_machine_levels()
    ],
    cmdclass={"build_ext": BuildKernels},
)
