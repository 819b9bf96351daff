"""Builds the package's C sources (native/*.c) into shared libraries on first use, cached per user.

Nothing is prebuilt: the system C compiler ($CC, else `cc`, else `gcc`) compiles the source the
package ships, so the library builds from the package itself on a fresh machine. The library's
file name carries a hash of the source and the headers it includes, the flags and the
compiler's version, so a changed source or compiler never loads a stale build, and an unchanged
one is never rebuilt. Each build is written under a temporary name and renamed into place: two
processes that race both succeed, and a crashed build never leaves a half-written library under
the final name.

The cache: $JACKFIELD_CACHE if set, else ~/.cache/jackfield; libraries under its cpu_amx/.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "native"
BUILD_TIMEOUT_S = 300
STDERR_LINES = 6  # of the compiler's stderr, kept in the error (and so in the availability reason)


class NativeBuildError(RuntimeError):
    """The library could not be built; the message says why (compiler output included)."""


def cache_dir() -> Path:
    root = os.environ.get("JACKFIELD_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "jackfield") / "cpu_amx"


def find_compiler() -> str:
    """$CC when set (even when it names nothing: the user asked for it), else cc, else gcc."""
    chosen = os.environ.get("CC")
    if chosen:
        return chosen
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise NativeBuildError("no C compiler: neither $CC, cc nor gcc is set or on PATH")
    return found


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"C compiler {compiler!r} could not run: {exc}") from exc
    if result.returncode != 0:
        raise NativeBuildError(f"{compiler} --version failed: {_first_lines(result.stderr)}")
    return result.stdout


def _first_lines(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:STDERR_LINES]) or "(no output)"


def build_library(
    source: Path,
    flags: Sequence[str],
    libs: Sequence[str] = (),
    cache: Path | None = None,
    headers: Sequence[Path] = (),
) -> Path:
    """The shared library built from `source` with `flags`, from the cache when already built.
    `headers`: the files `source` includes from the package, part of the cache key like it."""
    compiler = find_compiler()
    version = _compiler_version(compiler)
    digest = hashlib.sha256()
    for part in (
        source.read_bytes(),
        *(header.read_bytes() for header in headers),
        "\0".join([*flags, "--", *libs]).encode(),
        compiler.encode(),
        version.encode(),
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    cache = cache_dir() if cache is None else cache
    target = cache / f"{source.stem}-{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        command = [compiler, *flags, "-o", str(tmp), str(source), *libs]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeBuildError(f"{compiler} could not build {source.name}: {exc}") from exc
        if result.returncode != 0:
            failure = f"{compiler} failed on {source.name} (exit {result.returncode})"
            raise NativeBuildError(f"{failure}: {_first_lines(result.stderr)}")
        os.replace(tmp, target)  # atomic: a racing build's rename leaves either whole library
    finally:
        tmp.unlink(missing_ok=True)
    return target
