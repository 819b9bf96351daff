from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from checkpoints import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("engine-v3")
    write_checkpoint("v3", directory, seed=3)
    return directory
