"""The frozen records that plugins return from their hooks.

A factory is either the class itself or a lazy "module:attribute" string, so listing plugins
never imports kernels. Capabilities and availability probes are cheap and live in the record.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class AttentionBackendSpec:
    name: str
    factory: Factory  # -> an AttentionBackend subclass
    capabilities: AttentionCapabilities
    availability: Callable[[], Availability] = _always_available
    priority: int = 0  # `auto` picks the highest-priority valid backend
    replaces: str | None = None  # name of a registered backend this one deliberately overrides
    description: str = ""


@dataclass(frozen=True)
class SamplerSpec:
    name: str
    factory: Factory  # -> a Sampler subclass (constructed with no arguments)
    replaces: str | None = None
    description: str = ""


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    factory: Factory  # -> a Drafter subclass
    replaces: str | None = None
    description: str = ""


@dataclass(frozen=True)
class KVConnectorSpec:
    name: str
    factory: Factory  # -> a callable returning (KVConnectorScheduler, KVConnectorWorker) parts
    replaces: str | None = None
    description: str = ""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # a Hugging Face `architectures` entry, e.g. "DeepseekV3ForCausalLM"
    factory: Factory  # -> a model class built from a transformers config
    replaces: str | None = None
    description: str = ""


AnySpec = AttentionBackendSpec | SamplerSpec | DrafterSpec | KVConnectorSpec | ModelSpec
