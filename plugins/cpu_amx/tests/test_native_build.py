"""Building the package's C sources: cache keying and reuse, atomic writes, compiler failures."""

from __future__ import annotations

import ctypes
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from jackfield_cpu_amx.native_build import NativeBuildError, build_library, cache_dir

SYSTEM_CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(SYSTEM_CC is None, reason="no C compiler (cc or gcc) on PATH")
FLAGS = ("-O1", "-fPIC", "-shared")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "answer.c"
    path.write_text("int answer(int x) { return 2 * x + 1; }\n")
    return path


def wrapper_compiler(tmp_path: Path, body: str) -> tuple[Path, Path]:
    """A compiler script that answers --version itself, and logs each build to a file before
    running `body`."""
    log = tmp_path / "builds.log"
    script = tmp_path / "wrapped-cc"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "wrapped-cc 1.0"; exit 0; fi\n'
        f'echo build >> "{log}"\n{body}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, log


def builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_cache_dir_follows_jackfield_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JACKFIELD_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "cpu_amx"
    monkeypatch.delenv("JACKFIELD_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "jackfield" / "cpu_amx"


def test_second_build_reuses_the_library_and_a_change_rebuilds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: Path
) -> None:
    compiler, log = wrapper_compiler(tmp_path, f'exec "{SYSTEM_CC}" "$@"')
    monkeypatch.setenv("CC", str(compiler))
    cache = tmp_path / "cache"
    first = build_library(source, FLAGS, cache=cache)
    assert ctypes.CDLL(str(first)).answer(20) == 41
    assert build_library(source, FLAGS, cache=cache) == first and builds(log) == 1
    assert build_library(source, (*FLAGS, "-DUNUSED"), cache=cache) != first and builds(log) == 2
    source.write_text("int answer(int x) { return 3 * x; }\n")
    changed = build_library(source, FLAGS, cache=cache)
    assert changed != first and builds(log) == 3
    assert ctypes.CDLL(str(changed)).answer(20) == 60


def test_failed_build_reports_the_compiler_output_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: Path
) -> None:
    """A failing compiler (after writing a partial output) leaves neither a library nor a
    temporary file, and its stderr's first lines are in the error."""
    compiler, _ = wrapper_compiler(
        tmp_path,
        'while [ "$1" != "-o" ]; do shift; done; echo partial > "$2"\n'
        'echo "answer.c:1: error: unknown type name" >&2; echo "1 error generated" >&2; exit 3',
    )
    monkeypatch.setenv("CC", str(compiler))
    cache = tmp_path / "cache"
    with pytest.raises(NativeBuildError, match=r"exit 3\): answer.c:1: error: unknown type name \| 1 error"):
        build_library(source, FLAGS, cache=cache)
    assert list(cache.iterdir()) == []


def test_missing_compiler_is_a_build_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: Path
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(NativeBuildError, match="/nonexistent/cc"):
        build_library(source, FLAGS, cache=tmp_path / "cache")


def test_racing_builds_all_get_one_whole_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: Path
) -> None:
    """Four builds at once into an empty cache (each compile slowed so they overlap): each
    returns the same path to a loadable library, and only that file is left."""
    compiler, log = wrapper_compiler(tmp_path, f'sleep 0.3; exec "{SYSTEM_CC}" "$@"')
    monkeypatch.setenv("CC", str(compiler))
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: build_library(source, FLAGS, cache=cache), range(4)))
    assert len(set(paths)) == 1 and builds(log) == 4
    assert list(cache.iterdir()) == [paths[0]]
    assert ctypes.CDLL(str(paths[0])).answer(1) == 3
