"""The import rules of docs/architecture.md ("Dependencies point one way"), read from the source.

Every `import` and `from ... import` statement (module level or inside a function) of core's and
the plugins' source is checked: core never imports a plugin, no plugin imports another or more of
core than its public surface, and inside core a module imports only from its own layer and the
layers above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src"
PLUGIN_SOURCES = sorted(path.parent for path in ROOT.glob("plugins/*/src/jackfield_*/__init__.py"))

# Core's layers, top first (docs/architecture.md): a module may import its own layer and those above.
LAYERS = [
    ("jackfield.contracts", "jackfield.config", "jackfield.model_files", "jackfield.gguf_files",
     "jackfield.ops"),
    ("jackfield.specs", "jackfield.hookspecs", "jackfield.plugins", "jackfield.builtins"),
    ("jackfield.attention", "jackfield.sampling", "jackfield.distributed"),
    ("jackfield.models",),
    ("jackfield.requirements", "jackfield.selection", "jackfield.preflight"),
    ("jackfield.engine",),
    ("jackfield.testing",),
    ("jackfield.serving", "jackfield.commands", "jackfield.cli", "jackfield"),
]
TESTING_MAY_IMPORT = {0, 1, 2, 3, 6}  # model harnesses need models; nothing needs the engine
PLUGIN_SURFACE = (
    "jackfield.contracts",
    "jackfield.specs",
    "jackfield.hookspecs",
    "jackfield.attention",
    "jackfield.ops",
    "jackfield.testing",
    # the building blocks of jackfield.models, for a plugin that builds a model (a family, or a
    # draft model such as spec_decode's EAGLE-3 head)
    "jackfield.models.layers",
    "jackfield.models.weights",
    "jackfield.models.hf_config",
    "jackfield.models.attention",
)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """The layer of a jackfield module: the most specific prefix that names it."""
    matches = [(len(p), i) for i, layer in enumerate(LAYERS) for p in layer if within(module, p)]
    assert matches, f"{module} is in no layer of LAYERS: add it there and to docs/architecture.md"
    return max(matches)[1]


def is_core_module(name: str) -> bool:
    """Whether jackfield.<x>... names a module of core, not an attribute of the package
    (`from jackfield import hookimpl`)."""
    if "." not in name:
        return False
    top = name.split(".")[1]
    return (CORE / "jackfield" / top).is_dir() or (CORE / "jackfield" / f"{top}.py").exists()


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, module: str) -> set[str]:
    """Every module `path` imports; `from a import b` counts as a.b (b may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def sources(src: Path, package: str) -> list[tuple[Path, str]]:
    return [(path, module_name(path, src)) for path in sorted((src / package).rglob("*.py"))]


def test_core_never_imports_a_plugin() -> None:
    found = [
        f"{module} imports {name}"
        for path, module in sources(CORE, "jackfield")
        for name in imported(path, module)
        if name.startswith("jackfield_")
    ]
    assert not found, found


@pytest.mark.parametrize("package", PLUGIN_SOURCES, ids=lambda path: path.name)
def test_a_plugin_imports_only_itself_and_core_s_public_surface(package: Path) -> None:
    found = []
    for path, module in sources(package.parent, package.name):
        for name in imported(path, module):
            other_plugin = name.startswith("jackfield_") and not within(name, package.name)
            private_core = (
                within(name, "jackfield")
                and is_core_module(name)
                and not any(within(name, p) for p in PLUGIN_SURFACE)
            )
            if other_plugin or private_core:
                found.append(f"{module} imports {name}")
    assert not found, found


def test_core_modules_import_only_their_own_layer_and_those_above() -> None:
    found = []
    for path, module in sources(CORE, "jackfield"):
        own = layer_of(module)
        allowed = TESTING_MAY_IMPORT if within(module, "jackfield.testing") else set(range(own + 1))
        for name in imported(path, module):
            if within(name, "jackfield") and name != "jackfield" and layer_of(name) not in allowed:
                found.append(f"{module} (layer {own + 1}) imports {name} (layer {layer_of(name) + 1})")
    assert not found, found


def test_a_broken_rule_is_found(tmp_path: Path) -> None:
    """The checks see through `from jackfield import x` and imports inside functions."""
    (tmp_path / "jackfield" / "ops").mkdir(parents=True)
    bad = tmp_path / "jackfield" / "ops" / "bad.py"
    bad.write_text("def f():\n    from jackfield import engine\n    import jackfield_cuda_mla.kernels\n")
    names = imported(bad, module_name(bad, tmp_path))
    assert {"jackfield.engine", "jackfield_cuda_mla.kernels"} <= names
    assert layer_of("jackfield.engine") > layer_of("jackfield.ops.bad")
