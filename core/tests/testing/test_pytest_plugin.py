"""The `jackfield` pytest plugin: gpu-marked tests skip without CUDA; loading it imports no kit or backend."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_marked_tests_skip_without_cuda(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_needs_gpu():\n    raise AssertionError('ran')\n\n"
        "def test_plain():\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout


def test_plugin_module_imports_nothing_beyond_the_package() -> None:
    code = (
        "import sys, jackfield, pytest; before = set(sys.modules); import jackfield.testing.pytest_plugin; "
        "print(sorted(m for m in set(sys.modules) - before if not m.startswith('jackfield.testing')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
