from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(variant) -> (directory, transformers model), built once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def get(variant: str) -> tuple[Path, object]:
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            made[variant] = (directory, write_checkpoint(variant, directory))
        return made[variant]

    return get
