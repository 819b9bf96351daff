"""jackfield.toml -> frozen dataclasses. Unknown keys and wrong types are errors naming the file,
the key and the closest valid key. CLI flags arrive as dotted overrides ("engine.block_size")."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDTypeName = Literal["auto", "bfloat16", "fp8_e4m3"]
KVScaleChoice = Literal["auto", "checkpoint", "calibrate"]


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # a local Hugging Face directory; None: the embedded default model
    dtype: DTypeName = "auto"  # auto: bfloat16 on CUDA, float32 on CPU


@dataclass(frozen=True)
class AttentionConfig:
    backend: str = "auto"  # the target model's backend, every role unless named below
    prefill_backend: str | None = None
    decode_backend: str | None = None
    drafter_backend: str | None = None
    kv_cache_dtype: KVCacheDTypeName = "auto"
    # fp8_e4m3 caches' per-layer scales: "auto" (the checkpoint's k_scale / v_scale / kv_scale
    # where it has them, else calibrated), "checkpoint" (the checkpoint's, refused without them),
    # "calibrate" (amax / 448 of each layer's KV in the first prefill, then frozen), or a number
    # (that scale for every layer's keys and values)
    kv_scale: KVScaleChoice | float = "auto"


@dataclass(frozen=True)
class SamplerConfig:
    name: str = "murmur3"
    seed: int = 0  # seeds the engine generator that gives seeds to requests without one


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # a registered drafter name
    num_speculative_tokens: int = 0
    model: str | None = None  # a draft checkpoint directory (drafters with their own weights)
    prompt_lookup_min: int = 5  # n-gram: the shortest suffix matched (vLLM's default)
    prompt_lookup_max: int = 5  # n-gram: the longest suffix matched


@dataclass(frozen=True)
class KVConnectorConfig:
    name: str | None = None  # a registered KV connector name (`jackfield plugins` lists them)
    options: Mapping[str, Any] = field(default_factory=dict)  # the connector's own (its check_options)


@dataclass(frozen=True)
class ParallelConfig:
    # ranks the weights are split over (torchrun's --nproc-per-node; docs/parallelism.md)
    tensor_parallel_size: int = 1
    # decode context parallel: ranks of the tensor-parallel group that split each request's KV
    # cache between them (divides tensor_parallel_size, as vLLM's)
    dcp_size: int = 1
    # consecutive tokens that go to one DCP rank before the next (divides engine.block_size)
    dcp_interleave: int = 1


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int | None = None  # None: the chosen backends' preferred size (selection.pick_block_size)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    gpu_memory_fraction: float = 0.85  # of the free device memory, for the KV cache
    cpu_kv_cache_gib: float = 1.0
    # intra-op threads of CPU steps: "auto" times decode steps at torch's thread count and its
    # halvings once, at start-up, and keeps the fastest (engine/cpu_threads.py); a number pins it
    cpu_threads: int | Literal["auto"] = "auto"
    enable_prefix_caching: bool = True
    # the root of the chained block hashes (prefix cache and KV connector keys): processes that
    # share a KV tier must use the same seed
    prefix_hash_seed: int = 0
    # replay decode steps, and prefill pieces between attention calls, from CUDA graphs
    cuda_graphs: bool = True
    # the largest prefill/mixed step (in tokens) replayed from graphs; larger ones run eagerly
    # (GPU-bound: on the H200 a replayed 8192-token step ran 5-10% slower than the eager one, a
    # 512-token step 3x faster); 0: prefill steps always run eagerly
    prefill_graph_max_tokens: int = 2048
    # schedule and stage step N+1 while the device runs step N (decode steps; vLLM's
    # --async-scheduling); None: on for CUDA, off on the CPU (nothing to overlap there)
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class JackfieldConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_connector: KVConnectorConfig = field(default_factory=KVConnectorConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


class ConfigError(ValueError):
    """Every problem found in a config, one per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _closest(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {match[0]!r}?)" if match else f" (valid: {', '.join(valid)})"


def _check_type(value: object, annotation: object) -> str | None:
    """None when `value` fits `annotation`, else the expected type in words."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        return None if value in choices else "one of " + ", ".join(repr(c) for c in choices)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        failures = [_check_type(value, option) for option in options]
        return None if any(f is None for f in failures) else " or ".join(str(f) for f in failures)
    if annotation is type(None):
        return None if value is None else "null"
    if origin is not None and issubclass(origin, Mapping) or annotation is Mapping:
        return None if isinstance(value, Mapping) else "a table"
    if annotation is bool:
        return None if isinstance(value, bool) else "a boolean"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if annotation is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number and math.isfinite(value) else "a finite number"  # type: ignore[arg-type]
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    return None


def _as_declared(value: object, annotation: object) -> object:
    """An integer where the field takes a float but no integer (TOML's `1` for 1.0) as a float."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if union else (annotation,)
    takes_float = float in options and int not in options
    return float(value) if takes_float and isinstance(value, int) and not isinstance(value, bool) else value


def _range_problems(config: JackfieldConfig) -> list[str]:
    e, s, p = config.engine, config.speculative, config.parallel
    device_ok = re.fullmatch(r"auto|cpu|cuda(:\d+)?", e.device) is not None
    checks = [
        (config.model.path != "", "model.path is empty (leave it out for the embedded default model)"),
        (device_ok, f"engine.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {e.device!r}"),
        (e.block_size is None or e.block_size > 0, f"engine.block_size must be > 0, got {e.block_size}"),
        (e.max_num_seqs > 0, f"engine.max_num_seqs must be > 0, got {e.max_num_seqs}"),
        (e.max_num_batched_tokens > 0,
         f"engine.max_num_batched_tokens must be > 0, got {e.max_num_batched_tokens}"),
        (e.prefill_graph_max_tokens >= 0,
         f"engine.prefill_graph_max_tokens must be >= 0, got {e.prefill_graph_max_tokens}"),
        (e.max_model_len is None or e.max_model_len > 0,
         f"engine.max_model_len must be > 0, got {e.max_model_len}"),
        (0.0 < e.gpu_memory_fraction <= 1.0,
         f"engine.gpu_memory_fraction must be in (0, 1], got {e.gpu_memory_fraction}"),
        (0 < e.cpu_kv_cache_gib <= 2**33,  # 2**33 GiB = 2**63 bytes, the most a byte count can hold
         f"engine.cpu_kv_cache_gib must be > 0 and <= 2**33, got {e.cpu_kv_cache_gib}"),
        (e.cpu_threads == "auto" or e.cpu_threads >= 1,  # type: ignore[operator]
         f"engine.cpu_threads must be \"auto\" or >= 1, got {e.cpu_threads}"),
        (s.num_speculative_tokens >= 0,
         f"speculative.num_speculative_tokens must be >= 0, got {s.num_speculative_tokens}"),
        (s.method is None or s.num_speculative_tokens > 0,
         "speculative.num_speculative_tokens must be > 0 when speculative.method is set"),
        (1 <= s.prompt_lookup_min <= s.prompt_lookup_max,
         f"speculative.prompt_lookup_min ({s.prompt_lookup_min}) must be >= 1 and <= "
         f"speculative.prompt_lookup_max ({s.prompt_lookup_max})"),
        (s.model is None or s.model != "",
         "speculative.model is empty (leave it out when the drafter has none)"),
        (p.tensor_parallel_size >= 1,
         f"parallel.tensor_parallel_size must be >= 1, got {p.tensor_parallel_size}"),
        (p.dcp_size >= 1, f"parallel.dcp_size must be >= 1, got {p.dcp_size}"),
        (p.dcp_size < 1 or p.tensor_parallel_size % p.dcp_size == 0,
         f"parallel.dcp_size {p.dcp_size} must divide parallel.tensor_parallel_size "
         f"{p.tensor_parallel_size} (DCP reuses the tensor-parallel ranks)"),
        (p.dcp_interleave >= 1, f"parallel.dcp_interleave must be >= 1, got {p.dcp_interleave}"),
        (e.block_size is None or p.dcp_interleave < 1 or e.block_size % p.dcp_interleave == 0,
         f"parallel.dcp_interleave {p.dcp_interleave} must divide engine.block_size {e.block_size}"),
        (config.sampler.seed >= 0, f"sampler.seed must be >= 0, got {config.sampler.seed}"),
        (config.attention.drafter_backend is None or s.method is not None,
         "attention.drafter_backend is set but speculative.method is not"),
        (config.attention.kv_scale == "auto" or config.attention.kv_cache_dtype == "fp8_e4m3",
         f"attention.kv_scale = {config.attention.kv_scale!r} is set but attention.kv_cache_dtype is "
         f"{config.attention.kv_cache_dtype!r}: scales apply to fp8_e4m3 caches only"),
        (isinstance(config.attention.kv_scale, str) or config.attention.kv_scale > 0,
         f"attention.kv_scale must be > 0, got {config.attention.kv_scale}"),
        (not config.kv_connector.options or config.kv_connector.name is not None,
         "kv_connector.options is set but kv_connector.name is not"),
    ]
    return [message for ok, message in checks if not ok]


def _nest(overrides: Mapping[str, object]) -> dict[str, dict[str, object]]:
    nested: dict[str, dict[str, object]] = {}
    for dotted, value in overrides.items():
        section, sep, key = dotted.partition(".")
        if not sep:
            raise ConfigError([f"override {dotted!r} must be 'section.key'"])
        nested.setdefault(section, {})[key] = value
    return nested


def build_config(data: Mapping[str, object], source: str = "<config>") -> JackfieldConfig:
    """Validate a parsed TOML document (every problem reported at once) into a config."""
    problems: list[str] = []
    sections: dict[str, object] = {}
    section_fields = {f.name: f for f in dataclasses.fields(JackfieldConfig)}
    for name, table in data.items():
        if name not in section_fields:
            problems.append(f"{source}: unknown section [{name}]{_closest(name, list(section_fields))}")
            continue
        if not isinstance(table, Mapping):
            problems.append(f"{source}: [{name}] must be a table, got {type(table).__name__}")
            continue
        cls = typing.get_type_hints(JackfieldConfig)[name]
        hints = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for key, value in table.items():
            if key not in hints:
                problems.append(f"{source}: unknown key {name}.{key}{_closest(key, list(hints))}")
                continue
            expected = _check_type(value, hints[key])
            if expected is not None:
                problems.append(f"{source}: {name}.{key} must be {expected}, got {value!r}")
                continue
            values[key] = _as_declared(value, hints[key])
        sections[name] = cls(**values)
    # Keys with a wrong type keep their defaults here, so their neighbours' ranges are still checked.
    config = JackfieldConfig(**sections)  # type: ignore[arg-type]
    problems += [f"{source}: {p}" for p in _range_problems(config)]
    if problems:
        raise ConfigError(problems)
    return config


def _read_toml(path: Path) -> dict[str, object]:
    """A TOML file's tables; each way a file can be unreadable is a ConfigError naming it."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{source}: no such config file"]) from None
    except IsADirectoryError:
        raise ConfigError([f"{source}: is a directory, not a config file"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{source}: not UTF-8 text (byte {exc.start})"]) from None
    except OSError as exc:  # a symlink loop, no permission, a device that cannot be read
        raise ConfigError([f"{source}: cannot be read: {exc.strerror or exc}"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError([f"{source}: nested too deeply to be a config file"]) from None


def load_config(path: str | Path | None = None,
                overrides: Mapping[str, object] | None = None) -> JackfieldConfig:
    """Read `path` (TOML; None: defaults), then apply dotted `overrides` (CLI flags win)."""
    data: dict[str, dict[str, object]] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data = _read_toml(Path(path))
    for section, values in _nest(overrides or {}).items():
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError([f"{source}: [{section}] must be a table"])
        table.update(values)
    return build_config(data, source)


def _dotted(overrides: Mapping[str, object]) -> dict[str, object]:
    """`block_size=64` -> {"engine.block_size": 64}: a plain key must name one config field."""
    fields = {s.name: {f.name for f in dataclasses.fields(typing.get_type_hints(JackfieldConfig)[s.name])}
              for s in dataclasses.fields(JackfieldConfig)}
    dotted: dict[str, object] = {}
    for key, value in overrides.items():
        if "." in key:
            dotted[key] = value
            continue
        owners = [section for section, names in fields.items() if key in names]
        if not owners:
            every_name = sorted({name for names in fields.values() for name in names})
            raise ConfigError([f"override {key!r} matches no config field{_closest(key, every_name)}"])
        if len(owners) > 1:
            raise ConfigError([f"override {key!r} matches several sections: {', '.join(owners)}; "
                               f"use 'section.{key}'"])
        dotted[f"{owners[0]}.{key}"] = value
    return dotted


def resolve_config(config: JackfieldConfig | str | Path | None = None, model: str | Path | None = None,
                   overrides: Mapping[str, object] | None = None) -> JackfieldConfig:
    """The one config of an engine: a TOML path or a config object (validated like a file, since a
    hand-built one may be wrong), then `model` and the overrides (dotted "engine.block_size" or
    plain field names) on top."""
    if not isinstance(config, JackfieldConfig | str | Path | None):
        raise ConfigError([f"config must be a JackfieldConfig or a TOML path, got {type(config).__name__}"])
    if not isinstance(model, str | Path | None):
        raise ConfigError([f"model must be a model directory path, got {type(model).__name__}"])
    dotted = _dotted(overrides or {})
    if model is not None:
        dotted["model.path"] = str(model)
    if isinstance(config, JackfieldConfig):
        base = {f"{s.name}.{k}": v for s in dataclasses.fields(config)
                for k, v in dataclasses.asdict(getattr(config, s.name)).items()}
        return load_config(None, {**base, **dotted})
    return load_config(config, dotted)


def unsupported_features(config: JackfieldConfig) -> list[str]:
    """Combinations this engine does not run (not verified): fail before anything loads (doctor
    says so too). What needs the model's config (sliding windows, sinks under DCP) is preflight's."""
    problems = []
    if config.parallel.tensor_parallel_size > 1:
        if config.speculative.method is not None:
            problems.append("speculative decoding under tensor parallelism (parallel.tensor_parallel_size "
                            "> 1) is not verified: leave speculative.method out")
        if config.kv_connector.name is not None:
            problems.append("KV connectors under tensor parallelism (parallel.tensor_parallel_size > 1) are "
                            "not verified: leave kv_connector.name out")
    return problems
