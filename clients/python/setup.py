"""Builds tandem-client from the repository's common/ package, keeping only the client's modules.

common/ also holds server-side modules (tensors.py needs torch, server.py the reflection service);
the client's wheel leaves them out, so `import common.tensors` fails there instead of half-working.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# common's own modules that the client imports (common/client.py and what it imports, transitively),
# plus the packages listed in pyproject.toml (stubs, telemetry), which are taken whole.
CLIENT_MODULES = {"__init__", "auth", "channel", "client", "errors", "memory", "semconv", "status"}


class ClientModulesOnly(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package != "common":
            return modules
        return [(pkg, module, path) for pkg, module, path in modules if module in CLIENT_MODULES]


# Build output stays under clients/python/build (git-ignored), not in the repository root.
BUILD = Path(__file__).resolve().parent / "build"
BUILD.mkdir(exist_ok=True)
setup(cmdclass={"build_py": ClientModulesOnly}, options={"egg_info": {"egg_base": str(BUILD)}})
