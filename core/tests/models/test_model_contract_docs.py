"""docs/writing-a-plugin.md documents the model contract as it is in code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jackfield.contracts.model import ModelCapabilities, ModelFamily

DOC = Path(__file__).resolve().parents[3] / "docs/writing-a-plugin.md"


def test_every_abstract_member_and_capability_is_documented() -> None:
    section = DOC.read_text().split("## Models\n", 1)[1].split("\n## ", 1)[0]
    names = sorted(ModelFamily.__abstractmethods__) + [f.name for f in dataclasses.fields(ModelCapabilities)]
    assert len(names) > 15
    missing = [name for name in names if f"`{name}" not in section]
    assert not missing, f"docs/writing-a-plugin.md '## Models' does not mention {missing}"
