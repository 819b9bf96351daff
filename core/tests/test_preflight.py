"""doctor == run: every problem `jackfield doctor` reports, the Engine refuses with the same
message before loading, and both report all problems at once (jackfield.preflight)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from jackfield import LLM
from jackfield.cli import main
from jackfield.config import ConfigError

NO_SCALES_REASON = 'attention.kv_scale = "checkpoint", but the checkpoint has no KV scales'


def max_position_embeddings(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def doctor(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path,
           overrides: dict[str, object]) -> tuple[int, str]:
    """`jackfield doctor` on a TOML holding [model].path and `overrides` ("section.key": value)."""
    lines = [f'[model]\npath = "{model}"']
    for section in sorted({key.split(".")[0] for key in overrides}):
        lines.append(f"[{section}]")
        lines += [f"{key.split('.')[1]} = {json.dumps(value)}"
                  for key, value in overrides.items() if key.startswith(section + ".")]
    config = tmp_path / "jackfield.toml"
    config.write_text("\n".join(lines) + "\n")
    code = main(["doctor", "--config", str(config)])
    return code, capsys.readouterr().out


def llm_problems(model: Path, overrides: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        LLM(str(model), device="cpu", **overrides)
    return refused.value.problems


def assert_doctor_and_run_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path,
                                overrides: dict[str, object], *fragments: str) -> list[str]:
    code, out = doctor(tmp_path, capsys, model, overrides)
    problems = llm_problems(model, overrides)
    assert code == 2, out
    for problem in problems:  # the same messages, each on its own line
        assert "  - " + problem.replace("\n", "\n    ") in out
    for fragment in fragments:
        assert any(fragment in p for p in problems), (fragment, problems)
    return problems


def test_max_model_len_above_the_models_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              model: Path) -> None:
    limit = max_position_embeddings(model)
    too_long = random.randint(limit + 1, 8 * limit)
    assert_doctor_and_run_agree(tmp_path, capsys, model, {"engine.max_model_len": too_long},
                                f"engine.max_model_len {too_long} exceeds the model's "
                                f"max_position_embeddings {limit}")


def test_max_model_len_at_the_limit_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                model: Path) -> None:
    code, out = doctor(tmp_path, capsys, model, {"engine.max_model_len": max_position_embeddings(model)})
    assert code == 0, out


def test_pickle_only_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> None:
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    (model / "pytorch_model.bin").write_bytes(random.randbytes(64))
    assert_doctor_and_run_agree(tmp_path, capsys, model, {}, "pytorch_model.bin",
                                "convert them to safetensors")


def test_fp8_kv_cache_asking_for_checkpoint_scales_it_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> None:
    overrides = {"attention.kv_cache_dtype": "fp8_e4m3", "attention.kv_scale": "checkpoint"}
    assert_doctor_and_run_agree(tmp_path, capsys, model, overrides, NO_SCALES_REASON)


def test_fp8_kv_cache_with_per_head_checkpoint_scales(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> None:
    """Scales no backend can take are refused before loading, by name; doctor OK otherwise."""
    from safetensors.torch import load_file, save_file

    (weights,) = model.glob("*.safetensors")
    tensors = load_file(str(weights))
    heads = random.randint(2, 16)
    tensors["model.layers.0.self_attn.k_scale"] = torch.rand(heads) + 0.1
    save_file(tensors, str(weights), metadata={"format": "pt"})
    overrides = {"attention.kv_cache_dtype": "fp8_e4m3"}
    assert_doctor_and_run_agree(tmp_path, capsys, model, overrides,
                                f"model.layers.0.self_attn.k_scale has shape [{heads}]: per-head")
    code, out = doctor(tmp_path, capsys, model, {**overrides, "attention.kv_scale": "calibrate"})
    assert code == 0 and "kv cache: fp8_e4m3, scales (calibration)" in out, out


def test_unregistered_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> None:
    config_json = model / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()),
                                       "architectures": ["MysteryForCausalLM"]}))
    assert_doctor_and_run_agree(tmp_path, capsys, model, {}, "config.json", "MysteryForCausalLM",
                                "not registered")


def test_a_kv_budget_below_one_block_or_above_the_hosts_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> None:
    tiny = random.uniform(1e-12, 1e-9)
    assert_doctor_and_run_agree(tmp_path, capsys, model, {"engine.cpu_kv_cache_gib": tiny},
                                f"engine.cpu_kv_cache_gib = {tiny}", "does not fit one block")
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    huge = random.uniform(1.5, 100) * host_gib
    assert_doctor_and_run_agree(tmp_path, capsys, model, {"engine.cpu_kv_cache_gib": huge},
                                f"engine.cpu_kv_cache_gib = {huge}", "more than this host's memory")


def test_a_kv_cache_the_allocator_refuses_is_a_user_error(tmp_path: Path) -> None:
    """Within the host's memory but beyond what this process may allocate (an address-space
    limit stands in for a busy host): `run` exits 2 naming the settings, no traceback."""
    import resource
    import subprocess
    import sys

    limit = 7 * 2**30  # room for torch and the model, not for the cache
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget_gib = min(0.6 * host, 12 * 2**30) / 2**30
    assert budget_gib * 2**30 > limit + 2**30, f"a host of {host / 2**30:.1f} GiB is too small for this test"
    config = tmp_path / "big.toml"
    config.write_text(f"[engine]\ncpu_kv_cache_gib = {budget_gib}\nmax_num_seqs = 1000000\n"
                      "max_model_len = 2048\ndevice = \"cpu\"\n")
    result = subprocess.run(
        [sys.executable, "-m", "jackfield.cli", "run", "--config", str(config), "--max-tokens", "2"],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "allocating the KV cache" in result.stderr and "engine.cpu_kv_cache_gib" in result.stderr


def test_every_problem_is_reported_together(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            model: Path) -> None:
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    limit = max_position_embeddings(model)
    overrides = {"engine.max_model_len": limit + random.randint(1, limit),
                 "attention.backend": "no_such_backend", "sampler.name": "no_such_sampler"}
    problems = assert_doctor_and_run_agree(tmp_path, capsys, model, overrides,
                                           "exceeds the model's max_position_embeddings",
                                           "no *.safetensors files", "sampler.name", "no_such_backend")
    assert len(problems) >= 4
    backend_lines = [p for p in problems if "no_such_backend" in p]
    assert len(backend_lines) == 1 and "prefill" in backend_lines[0] and "decode" in backend_lines[0]


def test_doctor_notes_a_folder_without_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (model / name).unlink(missing_ok=True)
    code, out = doctor(tmp_path, capsys, model, {})
    assert code == 0, out
    assert "note:" in out and "has no tokenizer" in out and "text prompts are refused" in out
    llm = LLM(str(model), device="cpu")
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate("a text prompt")


def test_doctor_has_no_tokenizer_note_when_the_folder_has_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> None:
    code, out = doctor(tmp_path, capsys, model, {})
    assert code == 0, out
    assert "note:" not in out
