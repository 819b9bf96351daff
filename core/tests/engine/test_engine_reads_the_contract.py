"""The engine asks a model only what contracts/model.py declares: no probing of attributes."""

from __future__ import annotations

import ast
from pathlib import Path

import jackfield.engine

ENGINE_DIR = Path(jackfield.engine.__file__).parent


def test_no_engine_module_probes_objects_with_getattr_or_hasattr() -> None:
    found = []
    for path in sorted(ENGINE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr"):
                found.append(f"{path.name}:{node.lineno} {node.func.id}")
    assert len(list(ENGINE_DIR.glob("*.py"))) >= 10
    assert not found, f"the engine probes objects instead of reading their contracts: {found}"


def test_the_facade_stays_thin() -> None:
    lines = (ENGINE_DIR / "llm.py").read_text().count("\n")
    assert lines <= 200, f"engine/llm.py has {lines} lines; the facade's budget is 200"
