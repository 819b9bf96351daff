from __future__ import annotations

from pathlib import Path

import pytest
from jackfield.testing.checkpoints import write_deepseek


@pytest.fixture(scope="session")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("engine-v3")
    write_deepseek("v3", directory, seed=3)
    return directory
