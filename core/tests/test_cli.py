"""`jackfield plugins` and `jackfield doctor`: exit codes, every problem, no tracebacks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jackfield.cli import main
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
}


def model_dir(tmp_path: Path, **changes: object) -> Path:
    """A model folder with a config.json and a (content-free) safetensors file: enough for doctor,
    which reads no weights but, like run, refuses a folder without any."""
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**DEEPSEEK_V3, **changes}))
    save_file({"unused": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "jackfield.toml"
    path.write_text(text)
    return path


def test_plugins_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {
        "schema", "core", "plugins", "attention_backends", "samplers", "drafters", "kv_connectors", "models",
        "replaced",
    }
    assert data["schema"] == 1
    ref = next(b for b in data["attention_backends"] if b["name"] == "torch_ref")
    assert ref["available"] is True and ref["provider"] == "jackfield"
    assert ref["capabilities"]["kinds"] == ["mla", "mha"]
    assert "float32" in ref["capabilities"]["activation_dtypes"]


def test_plugins_text_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "builtins" in out and "torch_ref" in out and "murmur3" in out and "DeepseekV3ForCausalLM" in out


def test_doctor_accepts_a_good_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path,
                          f'[model]\npath = "{model_dir(tmp_path)}"\n[attention]\nbackend = "torch_ref"\n')
    assert main(["doctor", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "attention[decode]: torch_ref" in out and "DeepseekV3ForCausalLM" in out


def test_doctor_lists_every_problem_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = model_dir(tmp_path, architectures=["MysteryForCausalLM"])
    config = write_config(
        tmp_path,
        f'[model]\npath = "{model}"\n[attention]\nbackend = "no_such_backend"\n'
        '[sampler]\nname = "no_such_sampler"\n[kv_connector]\nname = "no_such_connector"\n'
        "[parallel]\ntensor_parallel_size = 2\n",
    )
    assert main(["doctor", "--config", str(config)]) == 2
    out = capsys.readouterr().out
    for fragment in (
        "no sampler named 'no_such_sampler'",
        "no kv_connector named 'no_such_connector'",
        "KV connectors under tensor parallelism (parallel.tensor_parallel_size > 1) are not verified",
        "MysteryForCausalLM",
        "'no_such_backend'",
    ):
        assert fragment in out, fragment
    assert "Traceback" not in out


def test_doctor_bad_toml_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "[engine]\nblok_size = 3\n")
    assert main(["doctor", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'block_size'" in err and "Traceback" not in err


def test_doctor_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().out


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_doctor_accepts_every_example(example: Path, tmp_path: Path) -> None:
    assert main(["doctor", "--config", str(example), "--model", str(model_dir(tmp_path))]) == 0


def test_doctor_names_the_drafter(capsys: pytest.CaptureFixture[str]) -> None:
    """The speculative example resolves to its drafter, k and the distribution that provides it."""
    assert main(["doctor", "--config", str(REPO / "examples" / "speculative_ngram.toml")]) == 0
    assert "  speculative: ngram, k = 3 (jackfield-spec-decode)\n" in capsys.readouterr().out


def test_console_script_runs_without_traceback(tmp_path: Path) -> None:
    config = write_config(tmp_path, "[engine]\nmax_num_seqs = -1\n")
    result = subprocess.run(
        [sys.executable, "-m", "jackfield.cli", "doctor", "--config", str(config)],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "engine.max_num_seqs must be > 0" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["doctor"], "engine.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ],
)
def test_user_errors_exit_2_without_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    config = write_config(tmp_path, '[engine]\ndevice = "tpu"\n' if args == ["doctor"] else "")
    result = subprocess.run(
        [sys.executable, "-m", "jackfield.cli", *args, "--config", str(config)],
        capture_output=True, text=True,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_run_with_a_drafter_reports_its_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    """--speculative-method / --num-speculative-tokens reach the engine; --json's summary has the
    run's drafts and acceptance, and the text output a line of them."""
    args = ["run", "--speculative-method", "ngram", "--num-speculative-tokens", "2", "--max-tokens", "12",
            "--prompt", "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3"]
    assert main([*args, "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["summary"]["speculative"]
    assert spec["method"] == "ngram" and spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    want = 1 + spec["accepted_tokens"] / max(spec["drafts"], 1)
    assert spec["mean_acceptance_length"] == pytest.approx(want, abs=1e-4)
    assert main(args) == 0
    assert "speculative (ngram):" in capsys.readouterr().out
    assert main([*args[:2], "eagle9", *args[3:]]) == 2
    assert "no drafter named 'eagle9'" in capsys.readouterr().err


def test_run_reports_the_fp8_kv_scales(capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-cache-dtype fp8_e4m3: --json holds the scales' source and every layer's values (the
    default model has no checkpoint scales: calibrated), the text a line with their range; a
    number from --set is every layer's scale."""
    args = ["run", "--kv-cache-dtype", "fp8_e4m3", "--max-tokens", "2", "--device", "cpu",
            "--prompt-token-ids", "5,17,42,9,61,3"]
    assert main([*args, "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache"]
    assert kv["dtype"] == "float8_e4m3fn" and kv["scale_source"] == "calibration"
    scales = kv["scales"]
    assert len(scales) == 4 and all(len(layer) == 1 and layer[0] > 0 for layer in scales)  # MLA: [record]
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("kv cache:"))
    low, high = min(s[0] for s in scales), max(s[0] for s in scales)
    assert line.endswith(f"4 layers, record {low:.4g}..{high:.4g}"), line
    scale = round(random.uniform(0.01, 0.1), 4)
    assert main([*args, "--json", "--set", f"attention.kv_scale={scale}"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache"]
    assert kv["scale_source"] == "config" and kv["scales"] == [[torch.tensor(scale).item()]] * 4


def test_run_flags_reach_the_sampler_and_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    """--prompt-token-ids gives the Python API's tokens for the same SamplingParams; --top-k 1 at
    temperature 1 samples the argmax (greedy's tokens); --set and config flags reach the engine."""
    from jackfield import LLM, SamplingParams

    prompt = [5, 17, 42, 9]
    want = LLM(None).generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids
    base = ["run", "--prompt-token-ids", ",".join(map(str, prompt)), "--max-tokens", "6", "--json"]
    for extra in (["--temperature", "0"], ["--top-k", "1", "--seed", "7"]):
        assert main([*base, *extra, "--set", "engine.max_num_seqs=3", "--dtype", "float32"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["outputs"][0]["token_ids"] == want and out["dtype"] == "torch.float32"
    assert main([*base, "--set", "engine.max_num_seqs=-3"]) == 2
    assert "engine.max_num_seqs must be > 0, got -3" in capsys.readouterr().err
    assert main([*base, "--set", "nonsense"]) == 2
    assert "expected SECTION.KEY=VALUE" in capsys.readouterr().err
    assert main(["run", "--prompt-token-ids", "1,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_run_n_and_penalty_flags_match_the_python_api(capsys: pytest.CaptureFixture[str]) -> None:
    """--n gives one JSON entry per sample (seeds seed, seed + 1); penalties and --stop reach
    SamplingParams as the API takes them."""
    from jackfield import LLM, SamplingParams

    prompt = [5, 17, 42, 9, 5, 17]
    params = SamplingParams(n=2, seed=4, max_tokens=6, repetition_penalty=1.4, frequency_penalty=0.3)
    want = LLM(None).generate([prompt], params, use_tqdm=False)[0]
    args = ["run", "--prompt-token-ids", ",".join(map(str, prompt)), "--max-tokens", "6", "--n", "2",
            "--seed", "4", "--repetition-penalty", "1.4", "--frequency-penalty", "0.3", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)["outputs"]
    assert [(o["index"], o["seed"], o["token_ids"]) for o in out] == [
        (c.index, c.seed, c.token_ids) for c in want.outputs]


def test_bench_reports_one_row_per_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--input-len", "8", "--output-len", "4", "--batch-size", "1", "3", "--num-iters", "1",
            "--warmup-iters", "0", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in out["results"]] == [1, 3]
    for row in out["results"]:
        assert row["output_tokens_per_s"] == pytest.approx(row["batch_size"] * 4 / row["latency_s_mean"],
                                                           rel=1e-2)
        assert 0 < row["time_to_first_token_s"] <= row["latency_s_mean"]
    assert main([*args[:-1], "--output-len", "0"]) == 2
    assert "--output-len must be >= 1" in capsys.readouterr().err


def test_run_chat_renders_each_prompt_as_a_user_message(model: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--chat: each --prompt goes through the model's chat template (as `LLM.chat` renders a
    one-turn conversation), the text prompt is what is printed; a model without a template, or
    --chat without text prompts, is a user error."""
    from jackfield import LLM, SamplingParams

    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    args = ["run", "--model", str(model), "--device", "cpu", "--chat", "--prompt", "Hello there",
            "--max-tokens", "5", "--temperature", "0", "--json"]
    assert main(args) == 2
    assert "has no chat template" in capsys.readouterr().err
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    want = LLM(str(model), device="cpu").chat([{"role": "user", "content": "Hello there"}],
                                              SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["prompt"] == "Hello there"
    assert out["outputs"][0]["token_ids"] == want.token_ids
    assert out["summary"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert main(["run", "--chat", "--prompt-token-ids", "1,2"]) == 2
    assert "--chat renders --prompt texts" in capsys.readouterr().err
