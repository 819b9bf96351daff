"""Every check that needs no weights: `jackfield doctor` reports these problems and the Engine
raises them (one ConfigError, all at once) before it loads anything, so the two cannot drift."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from jackfield.attention.kv_cache import cache_dtype
from jackfield.config import JackfieldConfig, unsupported_features
from jackfield.contracts.attention import AttentionRequirements
from jackfield.distributed.cp_common import dcp_gate, parallel_problems
from jackfield.gguf_files import checkpoint_dir
from jackfield.model_files import TOKENIZER_FILES, ModelFileError, RemoteCodeError
from jackfield.models.kv_scales import KVScalePlan, plan_kv_scales, read_checkpoint_kv_scales
from jackfield.models.weights import checkpoint_files, tensor_names
from jackfield.plugins import Registry, get_registry
from jackfield.requirements import attention_requirements, read_config_json
from jackfield.selection import BackendChoice, pick_block_size, resolve_attention
from jackfield.specs import KVConnectorSpec

__all__ = ["Preflight", "model_hf_config", "preflight", "prefix_cache_note", "tokenizer_note"]


@dataclass(frozen=True)
class Preflight:
    problems: list[str]  # empty: `run` starts
    attention: dict[str, BackendChoice] | None  # per role, where selection succeeded (kept, not redone)
    block_size: int | None = None  # engine.block_size, or the chosen backends' pick when it is None
    kv_scales: KVScalePlan | None = None  # an fp8_e4m3 KV cache's scales (None: not fp8)


def model_hf_config(config: JackfieldConfig) -> Mapping[str, object]:
    """config.json of [model].path, or of the embedded default model (built without writing it)."""
    if config.model.path is not None:  # a GGUF file converts here, once (gguf_files)
        return read_config_json(checkpoint_dir(config.model.path))
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
            checkpoint_files(checkpoint_dir(config.model.path))
        except FileNotFoundError as exc:
            problems.append(str(exc))
    problems += _model_drafter_problems(config, registry, hf_config)
    problems += _recurrent_layer_problems(config, hf_config)
    attention, block_size, kv_scales = None, config.engine.block_size, None
    att = config.attention
    problems += dcp_gate(config.parallel, {"prefill": att.prefill_backend or att.backend,
                                           "decode": att.decode_backend or att.backend}, registry)
    try:
        requirements = attention_requirements(hf_config, config)
        attention = resolve_attention(config, requirements)
    except (ValueError, KeyError) as exc:  # SelectionError is a ValueError; KeyError: a missing size
        problems.append(str(exc))
    if attention is not None:
        if block_size is None:
            block_size = pick_block_size(attention["decode"].backend, attention["prefill"].backend)
        problems += parallel_problems(config.parallel, requirements, block_size)
        problems += kv_budget_problems(config, hf_config, requirements, block_size)
        if requirements.kv_cache_dtype == "fp8_e4m3":
            kv_scales, scale_problems = fp8_kv_scale_plan(config, hf_config, requirements)
            problems += scale_problems
    return Preflight(problems, attention, block_size, kv_scales)


def fp8_kv_scale_plan(config: JackfieldConfig, hf_config: Mapping[str, object],
                      requirements: AttentionRequirements) -> tuple[KVScalePlan | None, list[str]]:
    """The fp8 cache's scales `attention.kv_scale` asks for, from the checkpoint's scale tensors
    alone (the embedded default model has none), or every reason they cannot be had."""
    num_layers = hf_config.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        return None, [f"config.json's num_hidden_layers is {num_layers!r}: fp8 KV scales are per layer"]
    mla = requirements.kind == "mla"
    files: list[Path] = []
    if config.model.path is not None:
        try:
            files = checkpoint_files(checkpoint_dir(config.model.path))
        except FileNotFoundError:  # reported above with the model's files
            return None, []
    try:
        checkpoint = read_checkpoint_kv_scales(files, num_layers, mla)
    except ModelFileError as exc:
        return None, [str(exc)]
    return plan_kv_scales(config.attention.kv_scale, checkpoint, num_layers, mla)


def kv_budget_problems(config: JackfieldConfig, hf_config: Mapping[str, object],
                       requirements: AttentionRequirements, block_size: int) -> list[str]:
    """A KV budget beyond this host's memory, or below one block of one layer (a lower bound of
    a block's size: the engine checks the exact size, every layer, once the model is built)."""
    engine = config.engine
    if requirements.kind == "mla":
        per_token = requirements.head_size
    else:
        kv_heads = hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads") or 1
        per_token = 2 * int(kv_heads) * requirements.head_size  # type: ignore[call-overload]
    itemsize = cache_dtype(requirements.kv_cache_dtype, requirements.dtype).itemsize
    one_layer_block = per_token * block_size * itemsize
    if requirements.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        budget = free * engine.gpu_memory_fraction
        where = f"engine.gpu_memory_fraction = {engine.gpu_memory_fraction} of {free / 2**30:.1f} GiB free"
    else:
        budget = engine.cpu_kv_cache_gib * 2**30
        where = f"engine.cpu_kv_cache_gib = {engine.cpu_kv_cache_gib}"
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if budget > host:
            return [f"{where} is more than this host's memory ({host / 2**30:.1f} GiB)"]
    if budget < one_layer_block:
        return [f"the KV cache budget ({where}) does not fit one block of one layer "
                f"({one_layer_block} bytes: {block_size} tokens x {per_token} values x {itemsize} bytes)"]
    return []


def tokenizer_note(config: JackfieldConfig) -> str | None:
    """A model folder without tokenizer files runs token-id prompts only: text prompts are refused."""
    if config.model.path is None:
        return None
    if any((checkpoint_dir(config.model.path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"{config.model.path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): "
            "prompts must be token ids, text prompts are refused")


def _hybrid_architecture(hf_config: Mapping[str, object]) -> str | None:
    """The config's built-in architecture with recurrent layers (None: none)."""
    from jackfield.models.hf_config import HYBRID_ARCHITECTURES

    archs = hf_config.get("architectures")
    found = [a for a in archs if a in HYBRID_ARCHITECTURES] if isinstance(archs, list) else []
    return found[0] if found else None


def _recurrent_layer_problems(config: JackfieldConfig, hf_config: Mapping[str, object]) -> list[str]:
    """What the engine does not run beside a model's recurrent layers (Gated DeltaNet, Mamba2)."""
    arch = _hybrid_architecture(hf_config)
    if arch is None:
        return []
    problems = []
    if config.kv_connector.name is not None:
        problems.append(f"kv_connector.name {config.kv_connector.name!r} with {arch} is not run yet: a "
                        "connector moves KV blocks, and the recurrent layers' state at a block boundary is "
                        "not kept")
    if config.attention.kv_cache_dtype == "fp8_e4m3":
        problems.append(f"attention.kv_cache_dtype 'fp8_e4m3' with {arch} is not run yet (fp8 scales are "
                        "kept per decoder layer; the recurrent layers' state stays float32)")
    return problems


def prefix_cache_note(config: JackfieldConfig, hf_config: Mapping[str, object]) -> str | None:
    """Why the prefix cache is off for a model with recurrent layers (None: nothing to say)."""
    arch = _hybrid_architecture(hf_config)
    if arch is None or not config.engine.enable_prefix_caching:
        return None
    return (f"engine.enable_prefix_caching is refused for {arch}: its recurrent layers keep one state per "
            "request, not per block (no state checkpoints at block boundaries), so a cached prefix "
            "cannot be resumed; every prompt is computed")


def _model_drafter_problems(config: JackfieldConfig, registry: Registry,
                            hf_config: Mapping[str, object]) -> list[str]:
    """A drafter with layers of the engine's (the checkpoint's multi-token-prediction layers, or
    a draft checkpoint's) runs them on the target's backends beside its KV caches; the checkpoint
    it needs must have them (config.json's num_nextn_predict_layers and their tensors), a draft
    checkpoint must pass the drafter's own check."""
    method = config.speculative.method
    drafter = registry.entries.get("drafter", {}).get(method or "")
    if drafter is None or not (drafter.spec.mtp_layers or drafter.spec.check_model is not None):
        return []  # a missing drafter is reported already
    from jackfield.models.hf_config import mtp_layers_problem  # imports transformers: only when needed

    config_json = Path(config.model.path) / "config.json" if config.model.path else "default config.json"
    layers = "the checkpoint's multi-token-prediction layers" if drafter.spec.mtp_layers else \
        "a draft checkpoint's layers"
    needs = f"speculative.method {method!r} runs {layers}"
    backend = config.attention.drafter_backend
    if backend is not None:
        return [f"attention.drafter_backend {backend!r}: {needs}, on the target's attention backends "
                "(they share its KV cache groups); leave it out"]
    connector = registry.entries.get("kv_connector", {}).get(config.kv_connector.name or "")
    if connector is not None and not connector.spec.model_drafters:  # KVConnectorSpec.model_drafters
        return [f"kv_connector.name {config.kv_connector.name!r} with speculative.method {method!r} is not "
                f"run yet: the connector does not declare model_drafters (its keys name a prefix, not "
                f"the token after it, which the KV of {layers} depends on)"]
    if config.attention.kv_cache_dtype == "fp8_e4m3":  # the scale plan covers the target's layers
        return [f"attention.kv_cache_dtype 'fp8_e4m3' with speculative.method {method!r} is not run yet: "
                f"the KV caches of {layers} have no fp8 scales"]
    if drafter.spec.check_model is not None:
        return [f"speculative.method {method!r}: {problem}"
                for problem in drafter.spec.check_model(config.speculative.model, hf_config)]
    problem = mtp_layers_problem(hf_config)
    if problem is not None:
        return [f"{needs}; {config_json}: {problem}"]
    if config.model.path is None:
        return []
    first = f"model.layers.{hf_config.get('num_hidden_layers')}."
    try:
        present = any(name.startswith(first) for name in tensor_names(checkpoint_dir(config.model.path)))
    except (FileNotFoundError, ValueError):  # no or unreadable checkpoint files: reported as such above
        return []
    if present:
        return []
    count = hf_config.get("num_nextn_predict_layers")
    return [f"{needs}; {config_json}: num_nextn_predict_layers is {count} "
            f"but the checkpoint has no {first}* tensors (the first MTP layer)"]


def _named_plugin_problems(config: JackfieldConfig, registry: Registry) -> list[str]:
    problems = []
    for kind, name, key in (("sampler", config.sampler.name, "sampler.name"),
                            ("drafter", config.speculative.method, "speculative.method"),
                            ("kv_connector", config.kv_connector.name, "kv_connector.name")):
        if name is None:
            continue
        try:
            entry = registry.lookup(kind, name)
        except KeyError as exc:
            problems.append(f"{key}: {exc.args[0]}")
            continue
        if isinstance(entry.spec, KVConnectorSpec) and entry.spec.check_options is not None:
            problems += entry.spec.check_options(config.kv_connector.options)
    return problems
