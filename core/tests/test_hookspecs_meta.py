"""Every hookspec is documented (docstring example + docs/writing-a-plugin.md) and tested."""

from __future__ import annotations

from pathlib import Path

import pytest
from jackfield import hookspecs

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("hook", sorted(hookspecs.HOOK_KINDS))
def test_hookspec_is_documented_and_tested(hook: str) -> None:
    function = getattr(hookspecs, hook)
    assert function.__doc__ and "Example::" in function.__doc__ and f"def {hook}():" in function.__doc__
    assert f"`{hook}`" in (REPO / "docs/writing-a-plugin.md").read_text()
    tests = "".join(p.read_text() for p in (REPO / "core/tests").glob("test_*.py")
                    if p.name != Path(__file__).name)
    assert f"def {hook}():" in tests, f"no test implements {hook}"


def test_hook_kinds_cover_every_hookspec() -> None:
    declared = {name for name in dir(hookspecs) if name.startswith("register_")}
    assert declared == set(hookspecs.HOOK_KINDS)
