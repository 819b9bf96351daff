from __future__ import annotations

from pathlib import Path

import pytest
from jackfield.testing.checkpoints import write_deepseek
from transformers import PreTrainedModel


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """checkpoint(variant) -> (directory, transformers model) of a DEEPSEEK_VARIANTS model, built
    once per session."""
    made: dict[str, tuple[Path, PreTrainedModel]] = {}

    def get(variant: str) -> tuple[Path, PreTrainedModel]:
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            made[variant] = (directory, write_deepseek(variant, directory))
        return made[variant]

    return get
