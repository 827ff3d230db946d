"""The import structure the layout promises, read from the source: every import counts, lazy or not."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.layout import REPO_ROOT, SOURCE_ROOTS, package_dir, python_files

DECODER = "tandem.decoder"
# Each decoder package imports only the ones after it (and common/); models/ is the leaf.
DECODER_LAYERS = ("api", "distributed", "engine", "config", "backends", "models")
ENGINE = f"{DECODER}.engine"
# Which engine sub-packages each one may import: the table in docs/ARCHITECTURE.md says the same.
# Every one may import the engine's two shared leaf modules, which import none of them.
ENGINE_IMPORTS = {
    "front": ("admission", "step", "outputs", "sampling", "scheduling"),
    "admission": ("outputs", "sampling"),
    "step": ("outputs", "sampling", "scheduling"),
    "outputs": ("scheduling",),
    "sampling": (),
    "scheduling": (),
}
ENGINE_LEAVES = ("params", "request")
PURE_PYTHON = ("engine.params", "engine.request", "engine.scheduling")  # a package: every module in it


@cache
def modules() -> dict[str, Path]:
    return python_files()


@cache
def imports(module: str) -> frozenset[str]:
    """Every module `module` imports, by full dotted name, wherever the import statement sits."""
    names = set()
    for node in ast.walk(ast.parse(modules()[module].read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = _absolute(module, node.module, node.level)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules() else base)
    return frozenset(names)


def _absolute(module: str, name: str | None, level: int) -> str:
    """The dotted name a `from` import names; relative ones resolved against `module`'s package."""
    if not level:
        return name or ""
    package = module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports (a package's own __init__ imports aside)."""
    found = set()
    for name in imports(module):
        while name and name not in modules():
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = {m: project_imports(m) for m in modules()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _layer(module: str) -> str | None:
    if not module.startswith(DECODER + "."):
        return None
    return module.removeprefix(DECODER + ".").split(".")[0]


def test_decoder_packages_import_only_the_layers_below_them() -> None:
    upward = []
    for module in modules():
        layer = _layer(module)
        if layer not in DECODER_LAYERS:
            continue
        for target in project_imports(module):
            target_layer = _layer(target)
            if target_layer in DECODER_LAYERS and DECODER_LAYERS.index(target_layer) < DECODER_LAYERS.index(
                layer
            ):
                upward.append(f"{module} -> {target}")
            is_shared = target.startswith(("tandem.common", "tandem.client"))
            if target.startswith("tandem.") and not is_shared and target_layer is None:
                upward.append(f"{module} -> {target}")  # the decoder never imports the encoder or the CLI
    assert not upward


def test_models_is_a_leaf_that_imports_only_itself_and_common() -> None:
    outside = [
        f"{module} -> {target}"
        for module in modules()
        if module.startswith(f"{DECODER}.models")
        for target in project_imports(module)
        if not target.startswith((f"{DECODER}.models", "tandem.common", "tandem.client"))
    ]
    assert not outside


def test_scheduling_modules_are_pure_python() -> None:
    checked = [m for m in modules() for name in PURE_PYTHON if _is_in(m, f"{DECODER}.{name}")]
    assert len(checked) > len(PURE_PYTHON)  # the scheduling package's modules, not only its __init__
    for module in checked:
        heavy = [n for n in imports(module) if n.split(".")[0] in ("torch", "grpc", "numpy")]
        assert not heavy, f"{module} imports {heavy}"


def _is_in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _engine_part(module: str) -> str | None:
    """The engine sub-package or leaf module `module` belongs to (None outside the engine)."""
    if not module.startswith(ENGINE + "."):
        return None
    return module.removeprefix(ENGINE + ".").split(".")[0]


def test_the_engine_is_its_leaf_modules_and_sub_packages_that_each_say_what_they_own() -> None:
    root = package_dir(ENGINE)
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", *(f"{m}.py" for m in ENGINE_LEAVES)]
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(ENGINE_IMPORTS)
    for package in packages:
        docstring = ast.get_docstring(ast.parse((root / package / "__init__.py").read_text()))
        assert docstring and "\n" not in docstring.strip(), (
            f"engine/{package}/__init__.py: one-line docstring"
        )


def test_architecture_md_states_the_engine_imports_this_test_enforces() -> None:
    text = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `(\w+)/` +\|.*\| ([\w, ]+?) +\|$", text, flags=re.MULTILINE)
    stated = {name: () if allowed == "none" else tuple(allowed.split(", ")) for name, allowed in rows}
    assert stated == ENGINE_IMPORTS


def test_engine_sub_packages_import_only_the_ones_they_are_allowed() -> None:
    crossing = []
    for module in modules():
        part = _engine_part(module)
        if part is None:
            continue
        if part in ENGINE_LEAVES:
            allowed = set(ENGINE_LEAVES)  # the leaves import no sub-package
        else:
            allowed = {part, *ENGINE_LEAVES, *ENGINE_IMPORTS.get(part, ())}
        for target in project_imports(module):
            target_part = _engine_part(target)
            if target_part is not None and target_part not in allowed:
                crossing.append(f"{module} -> {target}")
    assert not crossing


def test_only_the_parallel_module_calls_torch_distributed() -> None:
    users = sorted(m for m in modules() if any(n.startswith("torch.distributed") for n in imports(m)))
    assert users == [f"{DECODER}.distributed.parallel"]


def test_the_client_imports_neither_torch_nor_opentelemetry_when_loaded() -> None:
    seen, pending = set(), ["tandem.client.client"]
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        tree = ast.parse(modules()[module].read_text())
        top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        for node in top_level:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(n.split(".")[0] in ("torch", "numpy", "opentelemetry") for n in names), module
        pending.extend(t for t in project_imports(module) if t in _top_level_targets(tree))
    assert "tandem.client.telemetry" not in seen


def _top_level_targets(tree: ast.Module) -> set[str]:
    targets = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            targets.add(node.module)
            targets.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
    return targets


def test_every_decoder_package_says_what_it_owns_and_the_top_level_is_packages() -> None:
    root = package_dir(DECODER)
    for package in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert docstring and "\n" not in docstring.strip(), f"{package.name}/__init__.py: one-line docstring"
    files = sorted(p.name for p in root.glob("*.py"))
    assert files == ["__init__.py", "__main__.py", "config.py"]


def test_the_model_is_plain_torch_and_the_cpu_kernels_live_in_the_cpu_backend() -> None:
    # The model package holds no native code and no hook for it: the CPU executor binds kernels from
    # outside (backends/cpu/) and passes them to the model's one forward (models/kernels.py), which
    # without them is the reference it is tested against.
    models = package_dir(f"{DECODER}.models")
    assert not [p.name for p in models.iterdir() if p.suffix in (".c", ".h", ".so")]
    for module in (m for m in modules() if m.startswith(f"{DECODER}.models")):
        assert "ctypes" not in imports(module), module
        assert not any(n.startswith(f"{DECODER}.backends") for n in imports(module)), module
        assert ".native" not in modules()[module].read_text(), f"{module} still has a native hook"
    cpu = package_dir(f"{DECODER}.backends.cpu")
    native = sorted(p for root in SOURCE_ROOTS for p in (root / "tandem").rglob("*.[ch]"))
    assert native and all(p.parent == cpu / "csrc" for p in native), native
    decoder_users = sorted(m for m in modules() if m.startswith(DECODER) and "ctypes" in imports(m))
    assert decoder_users and all(m.startswith(f"{DECODER}.backends.cpu.") for m in decoder_users)


def test_the_client_package_imports_itself_only_by_relative_path() -> None:
    # It ships alone as `tandem_client` (clients/python/pyproject.toml), where `tandem.` does not exist:
    # an absolute `from tandem.client...` import works here and breaks the installed client.
    offenders = []
    for module, path in modules().items():
        if not module.startswith("tandem.client") or ".pb." in module:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("tandem")
            ):
                offenders.append(f"{module}: from {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith("tandem") for a in node.names):
                offenders.append(f"{module}: import {node.names[0].name}")
    assert offenders == []


# The gateway's own modules and the torch-free half of the dtype table (the command that starts the
# gateway is added by the check itself).
GATEWAY_ENTRY_POINTS = (
    *sorted(m for m in modules() if m.startswith("tandem.gateway")),
    "tandem.common.dtypes",
)
_LOADED_HEAVY = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from tandem import cli
cli.serve_group().get_command(None, "openai")  # what `tandem serve openai` imports before it runs
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy"})))
"""


def test_the_gateway_loads_neither_torch_nor_numpy() -> None:
    # In a fresh interpreter, so that what pytest and the other tests imported cannot hide an import;
    # sys.modules sees third-party imports too (a library that pulls numpy in), which the AST cannot.
    loaded = subprocess.run(
        [sys.executable, "-c", _LOADED_HEAVY, *GATEWAY_ENTRY_POINTS],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    ).stdout.split()
    assert loaded == []


def test_no_gateway_module_imports_torch_or_numpy_even_lazily() -> None:
    # The fresh interpreter above runs no handler; a function's own import runs only when it is called.
    seen, pending, offenders = set(), list(GATEWAY_ENTRY_POINTS), []
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        offenders += [f"{module}: {n}" for n in imports(module) if n.split(".")[0] in ("torch", "numpy")]
        pending.extend(project_imports(module))
    assert offenders == []


# The contract's part that needs torch or numpy (common/pyproject.toml's `tensors` extra); everything
# else of tandem.common and tandem.client is what the gateway and a torch-free install load.
TORCH_PART = "tandem.common.torch_part"
TENSORS_EXTRA = ("torch", "numpy", "safetensors", "tokenizers", "gguf", "cryptography")
TORCH_FREE_CONTRACT = tuple(
    sorted(
        m
        for m in modules()
        if m.split(".")[:2] in (["tandem", "common"], ["tandem", "client"])
        and m != TORCH_PART
        and not m.startswith(f"{TORCH_PART}.")
    )
)
# Any import of a blocked package fails, as it would where the `tensors` extra is not installed.
_IMPORT_BLOCKED = """
import importlib, sys
blocked = set(sys.argv[1].split(","))
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Blocked())
for name in sys.argv[2:]:
    importlib.import_module(name)
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & blocked)))
"""


def loaded_imports(module: str) -> frozenset[str]:
    """imports(module) less those under `if TYPE_CHECKING:`, which a running process never loads."""
    tree = ast.parse(modules()[module].read_text())
    typing_only = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        if isinstance(statement, ast.Import)
        for alias in statement.names
    }
    return imports(module) - typing_only


def test_the_contract_outside_its_torch_part_imports_no_tensor_library_even_lazily() -> None:
    # Read from the source, so that an import inside a function counts (one only a type checker reads
    # does not); importing the torch part would bring the same libraries in, so it counts too.
    offenders = []
    for module in TORCH_FREE_CONTRACT:
        offenders += [f"{module}: {n}" for n in loaded_imports(module) if n.split(".")[0] in TENSORS_EXTRA]
        offenders += [f"{module}: {n}" for n in project_imports(module) if n.startswith(TORCH_PART)]
    assert TORCH_FREE_CONTRACT  # the list is read from the tree: an empty one would check nothing
    assert offenders == []


def test_every_module_of_the_contract_outside_its_torch_part_loads_with_the_tensor_libraries_blocked() -> (
    None
):
    # In a fresh interpreter (nothing pytest loaded can hide an import), and by sys.modules, which
    # also sees a third-party library that pulls one of them in.
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_BLOCKED, ",".join(TENSORS_EXTRA), *TORCH_FREE_CONTRACT],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []
