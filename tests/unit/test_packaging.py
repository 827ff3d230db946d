"""The project installs as the design card lays it out.

Every pyproject.toml applies cleanly with setuptools (no deprecation warning on every install), the
`tandem` namespace package is assembled from the card's folders, and setup.py's CPU kernels never
stop an install.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

from tests.integration.test_images import distributions_imported, distributions_of, with_dependencies
from tests.layout import REPO_ROOT, SOURCE_ROOTS, UNITS, python_files


@pytest.mark.parametrize(
    "project", [".", "common", "services/encoder", "services/decoder", "services/gateway", "clients/python"]
)
def test_pyproject_applies_without_warnings_and_declares_an_spdx_license(
    project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = REPO_ROOT / project
    monkeypatch.chdir(directory)  # setuptools resolves the project's paths from the working directory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), directory / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert distribution.metadata.license_expression == "Apache-2.0"


KERNEL_SOURCES = Path("services/decoder/tandem/decoder/backends/cpu")
# What the two setup.py files (the workspace's and the decoder unit's) read: both use kernel_setup.py.
SETUP_FILES = (
    "setup.py",
    "pyproject.toml",
    "README.md",
    "services/decoder/setup.py",
    "services/decoder/pyproject.toml",
    "services/decoder/kernel_setup.py",
    f"{KERNEL_SOURCES}/build.py",
)


@pytest.mark.parametrize("project", [".", "services/decoder"])
@pytest.mark.parametrize(
    ("environment", "warned"),
    [
        ({"CC": "/nonexistent/cc"}, "no C compiler '/nonexistent/cc' on PATH"),  # a machine without one
        ({"TANDEM_BUILD_KERNELS": "0"}, None),  # an install that asks for none (a pure-Python tree)
    ],
)
def test_an_install_without_the_kernels_goes_on(
    project: str, environment: dict[str, str], warned: str | None, tmp_path: Path
) -> None:
    """Each ISA level is an optional extension: a failed build is a warning, never a failed install.
    Built here from a copy of what setup.py reads, so nothing lands in the checkout."""
    for name in SETUP_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    shutil.copytree(REPO_ROOT / KERNEL_SOURCES / "csrc", tmp_path / KERNEL_SOURCES / "csrc")
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "temp"],
        cwd=tmp_path / project,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.rglob("_kernels_*")) == []
    if warned is not None:
        assert warned in result.stderr
    assert ("building extension" in result.stderr) == (warned is not None)


def test_the_decoder_units_sdist_carries_what_its_setup_py_builds_the_kernels_from(tmp_path: Path) -> None:
    """An sdist of services/decoder (setup.py sdist, on a copy so nothing lands in the checkout) holds
    kernel_setup.py and every C source, and its setup.py runs from the unpacked archive alone."""
    unit = tmp_path / "decoder"
    shutil.copytree(
        REPO_ROOT / "services/decoder",
        unit,
        ignore=shutil.ignore_patterns("tests", "__pycache__", "_kernels_*", "*.egg-info", "build"),
    )
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
        cwd=unit,
        check=True,
        capture_output=True,
        timeout=120,
    )
    [archive] = (tmp_path / "dist").glob("tandem_decoder-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    [root] = (tmp_path / "unpacked").iterdir()
    assert (root / "kernel_setup.py").is_file()
    sources = sorted(p.name for p in (REPO_ROOT / KERNEL_SOURCES / "csrc").iterdir())
    assert (
        sorted(p.name for p in (root / KERNEL_SOURCES.relative_to("services/decoder") / "csrc").iterdir())
        == sources
    )
    result = subprocess.run(  # the kernels themselves: test_an_install_without_the_kernels_goes_on, build.py
        [sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "temp"],
        cwd=root,
        env={**os.environ, "TANDEM_BUILD_KERNELS": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# Which of the design card's folders holds each part of the `tandem` namespace package.
CARD_FOLDERS = {
    "tandem.common": "common",
    "tandem.client": "common",
    "tandem.cli": "common",
    "tandem.encoder": "services/encoder",
    "tandem.decoder": "services/decoder",
    "tandem.gateway": "services/gateway",
}
_WHERE_IMPORTED = """
import importlib, json, sys
import tandem
found = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}
print(json.dumps({"tandem": getattr(tandem, "__file__", None), "found": found}))
"""


def test_the_installed_packages_are_the_sources_in_the_card_folders_from_any_directory(
    tmp_path: Path,
) -> None:
    # From a directory outside the checkout, so that only the (editable) install can find them: each
    # module is the file in its card folder itself, so an edit there takes effect without reinstalling.
    result = subprocess.run(
        [sys.executable, "-c", _WHERE_IMPORTED, *CARD_FOLDERS],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    where = json.loads(result.stdout)
    assert where["tandem"] is None  # a PEP 420 namespace: no tandem/__init__.py anywhere
    for name, folder in CARD_FOLDERS.items():
        assert Path(where["found"][name]).is_relative_to(REPO_ROOT / folder / "tandem"), name


def test_each_card_folder_holds_a_tandem_folder_without_an_init_and_only_its_own_packages() -> None:
    assert {root.relative_to(REPO_ROOT).as_posix() for root in SOURCE_ROOTS} == set(CARD_FOLDERS.values())
    for root in SOURCE_ROOTS:
        assert not (root / "tandem" / "__init__.py").exists(), root
        packages = {p.name for p in (root / "tandem").iterdir() if (p / "__init__.py").is_file()}
        folder = root.relative_to(REPO_ROOT).as_posix()
        expected = {n.split(".")[1] for n, f in CARD_FOLDERS.items() if f == folder and n != "tandem.cli"}
        assert packages == expected, folder


# The services' units (services/*/pyproject.toml) and what their modules may import that no
# dependency installs: the Neuron backend's torch_xla needs a torch of its own (`make setup-xla`).
SERVICE_UNITS = {"encoder": (), "decoder": ("torch_xla",)}


# Each unit's extra for its own tests, and the extras its tests are installed with (common's torch part
# is tested too): `pip install -e './common[tensors,test]'`, `pip install -e ./common -e
# './services/gateway[test]'` (docs/ARCHITECTURE.md, "Each unit alone").
TEST_EXTRA = "test"
TEST_INSTALLS = {unit: {TEST_EXTRA} for unit in UNITS} | {"common": {"tensors", TEST_EXTRA}}


def _project(unit: str) -> dict:
    return tomllib.loads((REPO_ROOT / unit / "pyproject.toml").read_text())["project"]


def _requirements(unit: str, extras: set[str] | None = None) -> list[Requirement]:
    """A unit's dependencies with the extras it offers (all but the test extra unless named),
    tandem-common's expanded."""
    project = _project(unit)
    offered = project.get("optional-dependencies", {})
    lines = project["dependencies"] + [
        line
        for extra in offered
        if (extra in extras if extras is not None else extra != TEST_EXTRA)
        for line in offered[extra]
    ]
    found = []
    for requirement in map(Requirement, lines):
        if canonicalize_name(requirement.name) == "tandem-common":
            found += _requirements("common", requirement.extras)
        else:
            found.append(requirement)
    return found


@pytest.mark.parametrize("service", SERVICE_UNITS)
def test_a_service_units_dependencies_are_the_workspaces_and_cover_what_its_modules_import(
    service: str,
) -> None:
    """What the service's modules (and the common modules they use) import anywhere, lazily too, comes
    from its unit's dependencies, its extras and tandem-common's, or what they require; each of its
    own dependencies is imported; and every range is the workspace's own."""
    unit = f"services/{service}"
    own = {
        canonicalize_name(r.name)
        for r in _requirements(unit)
        if r not in _requirements("common", {"tensors"})
    }
    modules = [m for m in python_files() if m.startswith(f"tandem.{service}")]
    needed = distributions_imported(modules, exempt=SERVICE_UNITS[service])
    assert needed - with_dependencies({canonicalize_name(r.name) for r in _requirements(unit)}) == set()
    assert own - needed == set()
    workspace = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    ranges = workspace["dependencies"] + workspace["optional-dependencies"]["projector"]
    assert {str(r) for r in _requirements(unit)} <= {str(Requirement(line)) for line in ranges}


def _units_below(unit: str) -> list[str]:
    """The units `unit` depends on: the services each depend on tandem-common, the contract."""
    return ["common" for line in _project(unit)["dependencies"] if Requirement(line).name == "tandem-common"]


def _absolute_imports(path: Path) -> set[str]:
    """Every module a file imports by absolute name, wherever the statement sits (relative imports
    stay inside its own folder)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from tandem import cli` imports the module tandem.cli: `tandem` is a namespace package,
            # no file of its own (a name no module has sent the lookup below round for ever)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("unit", UNITS)
def test_each_units_tests_import_only_their_unit_the_units_below_it_and_their_test_install(unit: str) -> None:
    """`pytest <unit>` passes with only that unit and the units it depends on installed (their test
    installs: TEST_INSTALLS): its tests read Tandem's modules from those units only, test helpers from
    those units' tests/ folders only (never the cross-service tests/), and third-party modules from
    what those installs bring. Checked from the source; the fresh-venv runs are in ARCHITECTURE.md."""
    tests = REPO_ROOT / unit / "tests"
    assert (tests / "__init__.py").is_file() and any(tests.rglob("test_*.py")), unit
    units = [unit, *_units_below(unit)]
    folders = [REPO_ROOT / u for u in units]
    test_packages = tuple(".".join(Path(u, "tests").parts) for u in units)  # common.tests, ...
    modules = python_files()
    third_party = set()
    for path in tests.rglob("*.py"):
        where = path.relative_to(REPO_ROOT)
        for name in _absolute_imports(path):
            top = name.split(".")[0]
            if top == "tandem":
                module = name
                while module and module not in modules:  # an imported name's module, or its package
                    module = module.rpartition(".")[0]
                assert module, f"{where} imports {name}, which no file of this repository is"
                assert any(modules[module].is_relative_to(f) for f in folders), f"{where} imports {name}"
            elif top in ("tests", "common", "services"):
                assert name.startswith(tuple(p + "." for p in test_packages)), f"{where} imports {name}"
            elif top not in sys.stdlib_module_names:
                third_party.add(top)
    requirements = _requirements(unit, TEST_INSTALLS[unit])  # tandem-common's with the extras asked for
    installed = with_dependencies({canonicalize_name(r.name) for r in requirements})
    assert distributions_of(third_party) - installed == set()
    if unit == "services/gateway":
        assert "torch" not in installed  # the gateway's venv, tests and all, never has torch


def test_the_root_suite_runs_every_units_tests_and_each_test_extra_is_the_workspaces() -> None:
    """`make test` (pytest from the root) collects each unit's tests/ beside the cross-service ones, and
    a unit's test extra names the workspace's own ranges, so `make setup` installs what each needs."""
    root = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert set(root["tool"]["pytest"]["ini_options"]["testpaths"]) == {f"{u}/tests" for u in UNITS} | {
        "tests"
    }
    workspace = root["project"]["dependencies"] + root["project"]["optional-dependencies"]["dev"]
    for unit in UNITS:
        extra = _project(unit)["optional-dependencies"][TEST_EXTRA]
        assert {str(Requirement(line)) for line in extra} <= {str(Requirement(line)) for line in workspace}, (
            unit
        )


def test_the_cross_service_conftest_loads_with_what_the_neuron_venv_installs() -> None:
    """`make test` runs tests/xla in .venv-xla, which has the workspace and pytest but not the dev
    extra: tests/conftest.py, which it loads first, must import without the dev extra's libraries."""
    blocked = ("transformers", "peft", "scipy", "hypothesis", "accelerate")
    code = f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); import tests.conftest"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
