"""The `jackfield` pytest plugin: gpu-marked tests skip without CUDA, seeds are printed and reproduce
a run's draws, and loading it imports no kit or backend."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jackfield.testing.pytest_plugin import seed_of_test


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


SEEDED_TESTS = """
import random

import torch


def test_records(rng_seed):
    print("DRAW", rng_seed, random.random(), float(torch.rand(())))


def test_fails():
    assert torch.rand(()) < 0
"""


def _run_seeded(tmp_path: Path, seed: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_seeded.py").write_text(SEEDED_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "JACKFIELD_TEST_SEED"}
    if seed is not None:
        env["JACKFIELD_TEST_SEED"] = seed
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", *args, str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip


def _draws(result: subprocess.CompletedProcess[str]) -> list[str]:
    return re.findall(r"DRAW [^\n]*", result.stdout)


def test_seeds_are_printed_and_reproduce_the_draws(tmp_path: Path) -> None:
    first = _run_seeded(tmp_path, None)
    header = re.search(r"jackfield test seed: (\d+) \(reproduce with JACKFIELD_TEST_SEED=\1\)", first.stdout)
    assert header, first.stdout
    session = header.group(1)
    # the failing test's report names the session seed and its own
    section = rf"jackfield seed -+\nJACKFIELD_TEST_SEED={session} \(this test's seed: \d+\)"
    assert re.search(section, first.stdout)
    again = _run_seeded(tmp_path, session, "-k", "records")  # another selection, same draws
    assert _draws(again) == _draws(first) and len(_draws(first)) == 1
    other = _run_seeded(tmp_path, str(int(session) + 1))
    assert _draws(other) != _draws(first)


def test_seed_of_a_test_depends_on_the_session_and_the_test() -> None:
    assert seed_of_test(1, "a.py::t") == seed_of_test(1, "a.py::t")
    assert len({seed_of_test(1, "a.py::t"), seed_of_test(2, "a.py::t"), seed_of_test(1, "a.py::u")}) == 3
    assert all(0 <= seed_of_test(s, "x") < 2**32 for s in range(100))


def test_a_malformed_seed_is_a_usage_error(tmp_path: Path) -> None:
    result = _run_seeded(tmp_path, "abc")
    assert result.returncode == 4 and "JACKFIELD_TEST_SEED must be an integer, got 'abc'" in result.stderr
