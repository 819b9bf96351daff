"""The repo conftest's skip policy, on a throwaway test folder that uses it: skips are counted by
reason at the end, and a skip for anything but missing hardware fails the run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).parents[1] / "conftest.py"

TESTS = """
import pytest

def test_runs():
    pass

def test_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.parametrize("n", [1, 2])
def test_amx(n):
    pytest.skip("needs AMX hardware: the host's Xeon")

@pytest.mark.xfail(reason="an expected failure is not a skip")
def test_xfail():
    raise AssertionError
"""


def run_pytest(tmp_path: Path, tests: str, *args: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(ROOT_CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_policy.py").write_text(textwrap.dedent(tests))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip


def test_hardware_skips_are_counted_and_pass(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 skipped, by reason" in result.stdout
    assert "    2  hardware     needs AMX hardware: the host's Xeon" in result.stdout
    assert "    1  hardware     needs a CUDA GPU" in result.stdout
    assert "NOT ALLOWED" not in result.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])  # under xdist the controller counts
def test_any_other_skip_fails_the_run(tmp_path: Path, workers: list[str]) -> None:
    """A feature a backend lacks, a reason that only looks like an allowed one, and a module
    skipped at collection."""
    (tmp_path / "test_module_skip.py").write_text(
        'import pytest\npytest.skip("optional package missing", allow_module_level=True)\n'
    )
    tests = TESTS + textwrap.dedent("""
        def test_feature():
            pytest.skip("sinks not supported")

        def test_lookalike():
            pytest.skip("needs AMX hardware, roughly")
    """)
    result = run_pytest(tmp_path, tests, *workers)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "6 skipped, by reason" in result.stdout
    for reason in ("sinks not supported", "needs AMX hardware, roughly", "optional package missing"):
        assert f"    1  NOT ALLOWED  {reason}" in result.stdout
    assert "3 tests skipped for a reason other than missing hardware" in result.stdout
