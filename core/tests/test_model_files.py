"""A model folder is data: its code never runs, and each broken file is a named user error."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from jackfield.engine.tokenizer import load_tokenizer
from jackfield.model_files import ModelFileError, RemoteCodeError, read_config_json
from jackfield.models import hf_config

CANARY_SOURCE = "from pathlib import Path\nPath({canary!r}).write_text('model code ran')\n"


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def plant_code(model: Path, file: str, auto_map: dict[str, object], canary: Path) -> None:
    """Python files that would write `canary` if anything imported them, mapped from `file`."""
    for module in ("canary_config", "canary_model", "canary_tokenizer"):
        (model / f"{module}.py").write_text(CANARY_SOURCE.format(canary=str(canary)))
    edit_json(model / file, auto_map=auto_map)


CODE_MAPS = [
    ("config.json", {"AutoConfig": "canary_config.CanaryConfig",
                     "AutoModelForCausalLM": "canary_model.Canary"}),
    ("tokenizer_config.json", {"AutoTokenizer": ["canary_tokenizer.CanaryTokenizer", None]}),
]


@pytest.mark.parametrize(("file", "auto_map"), CODE_MAPS, ids=[f for f, _ in CODE_MAPS])
def test_llm_refuses_a_folder_with_model_code(model: Path, tmp_path: Path, file: str,
                                              auto_map: dict[str, object],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from jackfield import LLM

    canary = tmp_path / "canary"
    plant_code(model, file, auto_map, canary)
    with pytest.raises(RemoteCodeError, match=rf"{file}: auto_map .* Jackfield does not execute model code"):
        LLM(str(model), device="cpu")
    assert not canary.exists()
    assert capsys.readouterr().out == ""  # no prompt, nothing on stdout


@pytest.mark.parametrize(("file", "auto_map"), CODE_MAPS, ids=[f for f, _ in CODE_MAPS])
def test_cli_refuses_model_code_with_clean_json_stdout(model: Path, tmp_path: Path, file: str,
                                                      auto_map: dict[str, object]) -> None:
    canary = tmp_path / "canary"
    plant_code(model, file, auto_map, canary)
    for command in (["run", "--json", "--prompt", "hi"], ["doctor"]):
        result = subprocess.run([sys.executable, "-m", "jackfield.cli", *command, "--model", str(model)],
                                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        assert result.returncode == 2, result.stderr
        assert "does not execute model code" in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        if command[0] == "run":
            assert result.stdout == ""
    assert not canary.exists()


def test_transformers_is_told_not_to_trust_folder_code(model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Second line of defence: with Jackfield's own check switched off, transformers still runs
    nothing and does not prompt, because every call passes trust_remote_code=False."""
    canary = tmp_path / "canary"
    plant_code(model, "config.json", CODE_MAPS[0][1], canary)
    edit_json(model / "config.json", model_type="canary_only_in_the_folder")
    monkeypatch.setattr(hf_config, "read_config_json", lambda _: {})
    with pytest.raises(ModelFileError, match="transformers cannot read it"):
        hf_config.read_hf_config(model)
    plant_code(model, "tokenizer_config.json", CODE_MAPS[1][1], canary)
    monkeypatch.setattr("jackfield.engine.tokenizer.refuse_model_code", lambda _: None)
    with contextlib.suppress(ModelFileError):  # refused or loaded: either way, nothing may run
        load_tokenizer(model)
    assert not canary.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[1, 2, 3]", "must hold a JSON object, got a list"),
        (b'{"hidden_size": 64,', "not valid JSON"),
        (b'{"a": "\xff"}', "not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON|nested too deeply"),
        (b'{"hidden_size": -4}', "hidden_size must be an integer in \\[1, 2\\*\\*31 - 1\\], got -4"),
        (b'{"hidden_size": 64.5}', "hidden_size must be an integer in .*, got 64.5"),
        (b'{"num_hidden_layers": true}', "num_hidden_layers must be an integer in .*, got True"),
        (b'{"v_head_dim": null}', "v_head_dim must be an integer in .*, got None"),
        (b'{"vocab_size": "320"}', "vocab_size must be an integer in .*, got '320'"),
        (b'{"max_position_embeddings": 1e30}', "max_position_embeddings must be an integer in"),
        (b'{"hidden_size": 1000000000000000000000000000000}', "hidden_size must be an integer in"),
        (b'{"rms_norm_eps": NaN}', "rms_norm_eps must be a finite number > 0, got nan"),
        (b'{"first_k_dense_replace": -1}', "first_k_dense_replace must be an integer in \\[0, "),
        (b'{"architectures": "DeepseekV3ForCausalLM"}', "architectures must be a list of strings"),
        (b'{"eos_token_id": [1, -2]}', "eos_token_id must be a token id >= 0"),
    ],
)
def test_broken_config_json_names_file_and_field(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ModelFileError, match=rf"config\.json: .*({message})"):
        read_config_json(tmp_path)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jackfield.cli", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) >= 1
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_cli_broken_model_files_are_one_line_errors(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One fresh model copy broken in turn: config.json, tokenizer.json, the safetensors, the
    architecture; each a named user error from `jackfield run` (the first from a process of its
    own: the exit status and stderr a shell sees; the others from the CLI's `main`, in process)."""
    from jackfield.cli import main

    def run_in_process(*fragments: str) -> None:
        args = ["run", "--model", str(model)]
        code = main(args)
        captured = capsys.readouterr()
        assert_user_error(subprocess.CompletedProcess(args, code, captured.out, captured.err), *fragments)

    config = (model / "config.json").read_text()
    (model / "config.json").write_text("[1, 2]")
    assert_user_error(run_cli("run", "--model", str(model)), "config.json", "JSON object")
    (model / "config.json").write_text(config)

    tokenizer = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(tokenizer[: len(tokenizer) // 2])
    run_in_process("tokenizer.json", "not valid JSON")
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    run_in_process("tokenizer files", "cannot be loaded")
    (model / "tokenizer.json").write_text(tokenizer)

    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    run_in_process("model.safetensors")
    (model / "model.safetensors").write_bytes(b"garbage, not a safetensors file at all")
    run_in_process("model.safetensors")
    (model / "model.safetensors").write_bytes(weights)

    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[0]
    tensors[name].view(-1)[1] = float("nan")
    save_file(tensors, model / "model.safetensors")
    run_in_process("NaN or infinite values", name)
    (model / "model.safetensors").write_bytes(weights)

    edit_json(model / "config.json", architectures=["MysteryForCausalLM"])
    run_in_process("config.json", "MysteryForCausalLM")


def test_config_json_fields_of_the_wrong_type_never_escape_as_exceptions(
        model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Random config.json fields set to values of the wrong type or size: `run` either runs
    (a field the model ignores) or exits 2 naming config.json; no exception leaves the CLI."""
    import random

    from jackfield.cli import main

    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    original = json.loads((model / "config.json").read_text())
    bad_values = ["x", -1, None, [], {}, 1.5, True, 10**30, float("nan")]
    for key in rng.sample(sorted(original), 8):
        value = rng.choice(bad_values)
        (model / "config.json").write_text(json.dumps({**original, key: value}))
        code = main(["run", "--model", str(model), "--max-tokens", "2", "--prompt", "hi"])
        err = capsys.readouterr().err
        assert code in (0, 2), (key, value)
        if code == 2:
            assert "config.json" in err or "tokenizer" in err, (key, value, err)


def test_pickle_weights_are_refused_with_a_conversion_hint(model: Path) -> None:
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    assert_user_error(run_cli("run", "--model", str(model)), "no *.safetensors files",
                      "pytorch_model.bin are PyTorch pickles", "convert them to safetensors")
