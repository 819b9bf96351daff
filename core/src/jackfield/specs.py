"""The frozen records that plugins return from their hooks.

A factory is either the class itself or a lazy "module:attribute" string, so listing plugins
never imports kernels. Capabilities and availability probes are cheap and live in the record.
Each record checks its fields' types when built, so a plugin's mistake fails inside its own hook
(and is recorded against it) instead of in a listing or a selection that every plugin shares.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from jackfield.contracts.attention import AttentionCapabilities, Availability

Factory = str | type | Callable[..., object]


def resolve_factory(factory: Factory) -> object:
    """Import a "module:attribute" factory (or return a class/callable as is)."""
    if not isinstance(factory, str):
        return factory
    module_name, sep, attr = factory.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory {factory!r} must look like 'package.module:Attribute'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _always_available() -> Availability:
    return Availability.yes()


def _check_fields(spec: object) -> None:
    """TypeError naming every field of `spec` whose value has the wrong type."""
    problems = []
    for field in fields(spec):  # type: ignore[arg-type]
        value = getattr(spec, field.name)
        if field.name == "name" and not (isinstance(value, str) and value):
            problems.append(f"name must be a non-empty string, got {value!r}")
        elif field.name == "replaces" and not isinstance(value, str | None):
            problems.append(f"replaces must be a string or None, got {value!r}")
        elif field.name == "description" and not isinstance(value, str):
            problems.append(f"description must be a string, got {value!r}")
        elif field.name == "factory" and not (isinstance(value, str) or callable(value)):
            problems.append(f"factory must be a 'module:Attribute' string or a class, got {value!r}")
        elif field.name == "capabilities" and not isinstance(value, AttentionCapabilities):
            problems.append(f"capabilities must be an AttentionCapabilities, got {type(value).__name__}")
        elif field.name in ("check_options", "check_model") and not (value is None or callable(value)):
            problems.append(f"{field.name} must be a callable or None, got {value!r}")
        elif field.name == "availability" and not callable(value):
            problems.append(f"availability must be a callable probe, got {value!r}")
        elif field.name == "mtp_layers" and not isinstance(value, bool):
            problems.append(f"mtp_layers must be a bool, got {value!r}")
        elif field.name == "priority" and not (
                isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
            problems.append(f"priority must be a finite number, got {value!r}")
    if problems:
        raise TypeError(f"{type(spec).__name__}: " + "; ".join(problems))


class _CheckedSpec:
    """Every spec record checks its field types once built (a plugin's bad record fails in its hook)."""

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class AttentionBackendSpec(_CheckedSpec):
    name: str
    factory: Factory  # -> an AttentionBackend subclass
    capabilities: AttentionCapabilities
    availability: Callable[[], Availability] = _always_available
    priority: int = 0  # `auto` picks the highest-priority valid backend
    replaces: str | None = None  # name of a registered backend this one deliberately overrides
    description: str = ""


@dataclass(frozen=True)
class SamplerSpec(_CheckedSpec):
    name: str
    factory: Factory  # -> a Sampler subclass (constructed with no arguments)
    replaces: str | None = None
    description: str = ""


@dataclass(frozen=True)
class DrafterSpec(_CheckedSpec):
    name: str
    factory: Factory  # -> a TokenDrafter or ModelDrafter subclass
    replaces: str | None = None
    description: str = ""
    # Runs the target checkpoint's multi-token-prediction layers (DeepSeek's MTP): start-up
    # refuses a checkpoint without them and loads them (they are skipped otherwise).
    mtp_layers: bool = False
    # Runs a draft checkpoint's layers (`ModelDrafter.load`): ([speculative] model, the target's
    # config.json) -> every problem, each naming the file and field; run by `jackfield doctor`
    # and at start-up before anything loads (None: the drafter has no draft checkpoint).
    check_model: Callable[[str | None, Mapping[str, object]], list[str]] | None = None


@dataclass(frozen=True)
class KVConnectorSpec(_CheckedSpec):
    name: str
    factory: Factory  # -> a callable: KVConnectorContext -> (KVConnectorScheduler, KVConnectorWorker)
    # [kv_connector] options -> every problem, each naming its key; run by `jackfield doctor`
    # and at engine start-up before anything loads (None: the connector takes no options)
    check_options: Callable[[Mapping[str, object]], list[str]] | None = None
    replaces: str | None = None
    description: str = ""
    # Moves a model drafter's KV too (saved once the drafter wrote it) and never serves a block
    # whose drafter KV saw another request's next token: start-up refuses it beside such a
    # drafter otherwise (the block hashes it could key by cover a prefix, not the token after it).
    model_drafters: bool = False


@dataclass(frozen=True)
class ModelSpec(_CheckedSpec):
    name: str  # a Hugging Face `architectures` entry, e.g. "DeepseekV3ForCausalLM"
    factory: Factory  # -> a model class built from a transformers config
    replaces: str | None = None
    description: str = ""


AnySpec = AttentionBackendSpec | SamplerSpec | DrafterSpec | KVConnectorSpec | ModelSpec

# The record each kind's hook returns (hookspecs.HOOK_KINDS names the kinds).
SPEC_TYPES: dict[str, type] = {
    "attention": AttentionBackendSpec, "sampler": SamplerSpec, "drafter": DrafterSpec,
    "kv_connector": KVConnectorSpec, "model": ModelSpec,
}
