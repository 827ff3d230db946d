"""Builds tandem-client: the repository's common/tandem/client/ package, installed as `tandem_client`.

The client's modules import each other relatively, so the same files are `tandem.client` in the
server's package and `tandem_client` here: one source, two names, and no top-level package that the
server's wheel also installs.
"""

from pathlib import Path

from setuptools import setup

# Build output stays under clients/python/build (git-ignored), not in the repository root.
BUILD = Path(__file__).resolve().parent / "build"
BUILD.mkdir(exist_ok=True)
setup(options={"egg_info": {"egg_base": str(BUILD)}})
