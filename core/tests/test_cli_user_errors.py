"""User errors from the command line: exit 2 and a message naming the file and field, never a
traceback; a reader that closes the pipe early is not an error either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jackfield.cli import BROKEN_PIPE_EXIT, USER_ERROR_EXIT, main


def config_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == USER_ERROR_EXIT
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err


def test_config_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = config_error(["doctor", "--config", str(tmp_path)], capsys)
    assert f"{tmp_path}: is a directory, not a config file" in err


def test_config_that_is_a_symlink_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.symlink(tmp_path / "b.toml", tmp_path / "a.toml")
    os.symlink(tmp_path / "a.toml", tmp_path / "b.toml")
    err = config_error(["doctor", "--config", str(tmp_path / "a.toml")], capsys)
    assert f"{tmp_path / 'a.toml'}: cannot be read: Too many levels of symbolic links" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[engine]\nblock_size = 16 # caf\xe9\n", "not UTF-8 text (byte 30)"),
        (b"a = " + b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
        (b"x = {" * 50_000, "nested too deeply"),
        (b"[engine]\ncpu_kv_cache_gib = nan\n", "engine.cpu_kv_cache_gib must be a finite number, got nan"),
        (b"[engine]\ngpu_memory_fraction = inf\n",
         "engine.gpu_memory_fraction must be a finite number, got inf"),
        (b"[engine]\nblock_size = -16\n", "engine.block_size must be > 0, got -16"),
        (b"[engine]\ncpu_kv_cache_gib = 1e300\n",
         "engine.cpu_kv_cache_gib must be > 0 and <= 2**33, got 1e+300"),
    ],
)
def test_unreadable_config_files(tmp_path: Path, content: bytes, message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "jackfield.toml"
    path.write_bytes(content)
    err = config_error(["run", "--config", str(path)], capsys)
    assert err.startswith(f"jackfield run: error: {path}: ") and message in err, err


def test_prompt_that_is_not_utf8_is_a_user_error() -> None:
    result = subprocess.run([sys.executable, "-m", "jackfield.cli", "run", "--prompt", b"caf\xe9", "--json"],
                            capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == USER_ERROR_EXIT, stderr
    assert "is not valid UTF-8 text" in stderr and "Traceback" not in stderr
    assert result.stdout == b""


def test_plugins_into_a_closed_pipe_is_quiet() -> None:
    """`jackfield plugins | head -n 0`: the reader is gone before anything is written."""
    process = subprocess.Popen([sys.executable, "-m", "jackfield.cli", "plugins"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == BROKEN_PIPE_EXIT, stderr
    assert stderr == ""


@pytest.mark.parametrize("command", ["run", "doctor"])
def test_an_empty_model_path_is_an_error_not_the_default_model(command: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert "model.path is empty" in config_error([command, "--model", ""], capsys)


def test_an_empty_attention_backend_is_an_error_not_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert "no attention named ''" in config_error(["run", "--attention-backend", ""], capsys)
