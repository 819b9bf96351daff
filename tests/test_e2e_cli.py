"""`jackfield run` end to end in a fresh process: the embedded default model is created in an
empty cache dir, loaded like any checkpoint, and generates text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _jackfield(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JACKFIELD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "jackfield.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jackfield-cache")


def test_run_json_on_the_embedded_default(cache: Path) -> None:
    done = _jackfield(["run", "--prompt", "Hello", "--prompt", "A longer second prompt",
                       "--max-tokens", "6", "--temperature", "0.8", "--seed", "3",
                       "--attention-backend", "torch_ref", "--json"], cache)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (cache / "tiny-deepseek-v3-r2" / "config.json").is_file()
    assert report["backends"]["decode"] == {"name": "torch_ref", "reason": "named in the config"}
    assert [len(o["token_ids"]) for o in report["outputs"]] == [6, 6] or any(
        o["finish_reason"] == "stop" for o in report["outputs"])
    assert all(isinstance(o["text"], str) and o["seed"] == 3 for o in report["outputs"])
    assert report["summary"]["prompt_tokens"] == len("Hello") + len("A longer second prompt")
    again = _jackfield(["run", "--prompt", "Hello", "--prompt", "A longer second prompt",
                        "--max-tokens", "6", "--temperature", "0.8", "--seed", "3",
                        "--attention-backend", "torch_ref", "--json"], cache)
    assert json.loads(again.stdout)["outputs"] == report["outputs"]  # the cached model, the same tokens


def test_run_text_output_prints_backends_texts_and_summary(cache: Path) -> None:
    done = _jackfield(["run", "--max-tokens", "4"], cache)
    assert done.returncode == 0, done.stderr
    assert "decode attention:" in done.stdout and "prefill attention:" in done.stdout
    assert "generated tokens" in done.stdout and "tokens/s" in done.stdout


def test_run_with_an_unknown_backend_is_a_user_error(cache: Path) -> None:
    done = _jackfield(["run", "--attention-backend", "no_such_backend"], cache)
    assert done.returncode == 2
    assert "no_such_backend" in done.stderr and "Traceback" not in done.stderr
