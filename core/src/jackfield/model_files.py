"""Reading a model directory's JSON files: each problem names the file and the field.

No file of a model directory makes Jackfield run code. `auto_map` in config.json or a tokenizer or
processor config points transformers at Python files shipped in the folder (custom code); a folder
that carries it is refused before transformers sees it, and every transformers call passes
`trust_remote_code=False` as well, so it never prompts and never imports such a file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# The files whose `auto_map` transformers follows into the model folder's own Python files.
CODE_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")

# A folder with none of these has no tokenizer: it takes token-id prompts only.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# config.json sizes the engine builds tensors from: positive integers, or null where optional.
POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "sliding_window", "n_group", "topk_group",
    "index_n_heads", "index_head_dim", "index_topk",
)
# Of those, the ones no family leaves null (the rest may be null: q_lora_rank null is V2-Lite's
# plain q projection, sliding_window null is full attention, ...).
REQUIRED_WHEN_PRESENT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
NON_NEGATIVE_INT_FIELDS = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers",
                           "shared_intermediate_size",
                           "num_local_experts")  # 0: Granite 4.0 hybrid's dense MLP
POSITIVE_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")
INT32_MAX = 2**31 - 1  # tensor sizes and positions are int32 in the kernels' index arithmetic


class ModelFileError(ValueError):
    """A model directory file that cannot be used as it is (the message names file and field)."""


class RemoteCodeError(ModelFileError):
    """A model directory asks for its own Python code to run."""


def read_json_object(path: Path) -> dict[str, object]:
    """A JSON file holding one object, or a ModelFileError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ModelFileError(f"{path}: nested too deeply to be a model file") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: must hold a JSON object, got a {type(data).__name__}")
    return data


def refuse_model_code(model_dir: str | Path) -> None:
    """Raise RemoteCodeError when any config of `model_dir` maps classes to the folder's own code."""
    for name in CODE_MAP_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            auto_map = read_json_object(path).get("auto_map")
            if auto_map is not None:
                raise RemoteCodeError(
                    f"{path}: auto_map {json.dumps(auto_map)[:200]} asks to run Python code shipped with "
                    "the model; Jackfield does not execute model code (serve an architecture that "
                    "Jackfield or an installed plugin implements, without auto_map)"
                )


def config_field_problems(data: dict[str, object]) -> list[str]:
    """Fields of a config.json with the wrong type or range (JSON allows NaN and Infinity too)."""
    problems = []
    for key in (*POSITIVE_INT_FIELDS, *NON_NEGATIVE_INT_FIELDS):
        value = data.get(key)
        if value is None and not (key in REQUIRED_WHEN_PRESENT and key in data):
            continue
        lowest = 1 if key in POSITIVE_INT_FIELDS else 0
        if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= INT32_MAX:
            problems.append(f"{key} must be an integer in [{lowest}, 2**31 - 1], got {value!r}")
    for key in POSITIVE_NUMBER_FIELDS:
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not (0 < value < math.inf):
            problems.append(f"{key} must be a finite number > 0, got {value!r}")
    architectures = data.get("architectures")
    if architectures is not None and not (
            isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        problems.append(f"architectures must be a list of strings, got {architectures!r}")
    eos = data.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        problems.append(f"eos_token_id must be a token id >= 0 or a list of them, got {eos!r}")
    return problems


def read_config_json(model_dir: str | Path) -> dict[str, object]:
    """A model directory's config.json, checked: no model code anywhere in the folder, sizes that
    are integers in range. No transformers import (`doctor` stays cheap)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    refuse_model_code(model_dir)
    data = read_json_object(path)
    problems = config_field_problems(data)
    if problems:
        raise ModelFileError(f"{path}: " + "; ".join(problems))
    return data
