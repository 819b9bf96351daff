"""The hooks a plugin implements. Each returns an iterable of frozen spec records.

A plugin is a module with `@jackfield.hookimpl` functions, exposed through an entry point in
group "jackfield" and declaring `JACKFIELD_API = ">=1,<2"` (the core API versions it supports).
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from jackfield.specs import AttentionBackendSpec, DrafterSpec, KVConnectorSpec, ModelSpec, SamplerSpec

PROJECT = "jackfield"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_attention_backends() -> Iterable[AttentionBackendSpec]:
    """Attention backends this plugin provides.

    Example::

        @jackfield.hookimpl
        def register_attention_backends():
            return [AttentionBackendSpec(name="my_mla", factory="my_pkg.backend:MyMLABackend",
                                         capabilities=MY_CAPS, availability=probe, priority=50)]
    """


@hookspec
def register_samplers() -> Iterable[SamplerSpec]:
    """Samplers this plugin provides.

    Example::

        @jackfield.hookimpl
        def register_samplers():
            return [SamplerSpec(name="my_sampler", factory="my_pkg.sampler:MySampler")]
    """


@hookspec
def register_drafters() -> Iterable[DrafterSpec]:
    """Speculative-decoding drafters this plugin provides.

    Example::

        @jackfield.hookimpl
        def register_drafters():
            return [DrafterSpec(name="ngram", factory="my_pkg.ngram:NgramDrafter")]
    """


@hookspec
def register_kv_connectors() -> Iterable[KVConnectorSpec]:
    """KV connectors this plugin provides.

    Example::

        @jackfield.hookimpl
        def register_kv_connectors():
            return [KVConnectorSpec(name="cpu_offload", factory="my_pkg.offload:make_connector")]
    """


@hookspec
def register_models() -> Iterable[ModelSpec]:
    """Model families this plugin provides, keyed by a Hugging Face `architectures` name.

    Example::

        @jackfield.hookimpl
        def register_models():
            return [ModelSpec(name="MyForCausalLM", factory="my_pkg.model:MyForCausalLM")]
    """


HOOK_KINDS: dict[str, str] = {
    "register_attention_backends": "attention",
    "register_samplers": "sampler",
    "register_drafters": "drafter",
    "register_kv_connectors": "kv_connector",
    "register_models": "model",
}
