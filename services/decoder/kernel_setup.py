"""The CPU kernels as setuptools extensions: what both setup.py files (the workspace's at the repository
root and the decoder unit's beside this file) hand to `setup()`, so the build has one implementation.

One shared library per ISA level this machine's architecture has
(tandem/decoder/backends/cpu/build.py), each an optional extension: without a C compiler, or if a level
fails to build, pip says so and the install goes on; the decoder then logs one line and runs on torch
ops. The libraries are plain C loaded with ctypes, not Python modules: the compile command is
build.py's own, and each library gets build.py's record of the compiler's warnings beside it (which the
tests require empty). TANDEM_BUILD_KERNELS=0 builds none (an install
that never loads them; the encoder's and the gateway's images need not ask: they do not install
this unit).

Loaded by path, never imported: it sits outside the package, and importing the package would run the
decoder's __init__ modules in pip's isolated build environment, which has no torch (build.py and this
file need only the standard library and setuptools).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

_SPEC = importlib.util.spec_from_file_location(
    "tandem_kernel_build", Path(__file__).resolve().parent / "tandem/decoder/backends/cpu/build.py"
)
build = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)  # dataclasses look it up
_SPEC.loader.exec_module(build)


class BuildKernels(build_ext):
    """Each level with build.py's command (and CC, when set), written where setuptools expects it."""

    def finalize_options(self) -> None:
        # The levels are independent compiler runs, each one process: setuptools' parallel build_ext
        # runs them on a thread each, up to the CPU count, where they ran one after another (an
        # install's longest step), unless `build_ext -j N` says otherwise.
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        super().finalize_options()

    def build_extension(self, ext: Extension) -> None:
        levels = build.this_machine_levels()
        level = next(level for level in levels if ext.name.endswith(build.module_name(level)))
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        try:
            build.build_installed(os.environ.get("CC") or "cc", level, output)
        except RuntimeError as error:
            # The error setuptools skips an optional extension on (with a warning); any other stops
            # the whole install, which a missing compiler must not.
            raise CompileError(str(error)) from error

    # Each library's record (build.record_path) goes where the library goes: an editable install builds
    # in a build folder and copies only the libraries themselves into the source tree. (A wheel takes
    # the whole build folder, records included.)
    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        for built, in_tree in self.get_output_mapping().items():
            if build.record_path(Path(built)).is_file():
                self.copy_file(str(build.record_path(Path(built))), str(build.record_path(Path(in_tree))))


def kernel_setup_arguments(project_root: Path) -> dict[str, Any]:
    """`setup()`'s ext_modules and cmdclass for the project whose setup.py is in `project_root`
    (extension sources are named relative to it, as setuptools requires)."""
    return {
        "ext_modules": []
        if os.environ.get("TANDEM_BUILD_KERNELS") == "0"
        else [
            Extension(
                f"{build.PACKAGE}.{build.module_name(level)}",
                sources=[str(build.CSRC.relative_to(project_root) / source) for source in build.SOURCES],
                optional=True,
            )
            for level in build.this_machine_levels()
        ],
        "cmdclass": {"build_ext": BuildKernels},
    }
