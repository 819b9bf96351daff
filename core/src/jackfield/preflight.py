"""Every check that needs no weights: `jackfield doctor` reports these problems and the Engine
raises them (one ConfigError, all at once) before it loads anything, so the two cannot drift."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jackfield.config import JackfieldConfig, unsupported_features
from jackfield.model_files import TOKENIZER_FILES, RemoteCodeError
from jackfield.models.weights import checkpoint_files
from jackfield.plugins import Registry, get_registry
from jackfield.requirements import attention_requirements, read_config_json
from jackfield.selection import BackendChoice, pick_block_size, resolve_attention

__all__ = ["Preflight", "model_hf_config", "preflight", "tokenizer_note"]


@dataclass(frozen=True)
class Preflight:
    problems: list[str]  # empty: `run` starts
    attention: dict[str, BackendChoice] | None  # per role, where selection succeeded (kept, not redone)
    block_size: int | None = None  # engine.block_size, or the chosen backends' pick when it is None


def model_hf_config(config: JackfieldConfig) -> Mapping[str, object]:
    """config.json of [model].path, or of the embedded default model (built without writing it)."""
    if config.model.path is not None:
        return read_config_json(config.model.path)
    from jackfield.models.default_model import default_hf_config

    return default_hf_config()


def preflight(config: JackfieldConfig, registry: Registry | None = None) -> Preflight:
    """Every problem `config` has on this machine that shows without loading weights, one per line,
    and the attention backend chosen per role (selection probes backends: done once, here)."""
    registry = registry or get_registry()
    problems = _named_plugin_problems(config, registry) + unsupported_features(config)
    try:
        hf_config = model_hf_config(config)
    except RemoteCodeError:  # a folder shipping code is refused outright, as the security error it is
        raise
    except (FileNotFoundError, ValueError) as exc:  # ModelFileError is a ValueError
        return Preflight([*problems, str(exc)], None)
    architectures = list(hf_config.get("architectures") or [])  # type: ignore[call-overload]
    if not any(a in registry.entries["model"] for a in architectures):
        config_json = Path(config.model.path) / "config.json" if config.model.path else "default config.json"
        problems.append(f"{config_json}: model architectures {architectures} are not registered; "
                        f"registered: {', '.join(registry.names('model'))}")
    limit = hf_config.get("max_position_embeddings")
    max_model_len = config.engine.max_model_len
    if max_model_len is not None and isinstance(limit, int) and max_model_len > limit:
        problems.append(f"engine.max_model_len {max_model_len} exceeds the model's "
                        f"max_position_embeddings {limit}")
    if config.model.path is not None:  # the embedded default is written by Jackfield as safetensors
        try:
            checkpoint_files(config.model.path)
        except FileNotFoundError as exc:
            problems.append(str(exc))
    attention, block_size = None, config.engine.block_size
    try:
        attention = resolve_attention(config, attention_requirements(hf_config, config))
    except (ValueError, KeyError) as exc:  # SelectionError is a ValueError; KeyError: a missing size
        problems.append(str(exc))
    if attention is not None and block_size is None:
        block_size = pick_block_size(attention["decode"].backend, attention["prefill"].backend)
    return Preflight(problems, attention, block_size)


def tokenizer_note(config: JackfieldConfig) -> str | None:
    """A model folder without tokenizer files runs token-id prompts only: text prompts are refused."""
    if config.model.path is None:
        return None
    if any((Path(config.model.path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"{config.model.path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): "
            "prompts must be token ids, text prompts are refused")


def _named_plugin_problems(config: JackfieldConfig, registry: Registry) -> list[str]:
    problems = []
    for kind, name, key in (("sampler", config.sampler.name, "sampler.name"),
                            ("drafter", config.speculative.method, "speculative.method"),
                            ("kv_connector", config.kv_connector.name, "kv_connector.name")):
        if name is None:
            continue
        try:
            registry.lookup(kind, name)
        except KeyError as exc:
            problems.append(f"{key}: {exc.args[0]}")
    return problems
