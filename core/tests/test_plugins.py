"""Plugin discovery through real entry points, load controls, failures and conflicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jackfield.plugins import PluginConflictError, get_registry, load_registry
from jackfield.specs import resolve_factory

BACKEND_PLUGIN = '''
import jackfield
from jackfield.builtins import TORCH_REF_CAPABILITIES
from jackfield.specs import AttentionBackendSpec
JACKFIELD_API = ">=1.0,<2"

@jackfield.hookimpl
def register_attention_backends():
    return [AttentionBackendSpec(name="{name}", factory="jackfield.attention.torch_ref:TorchRefBackend",
                                 capabilities=TORCH_REF_CAPABILITIES, priority={priority}{extra})]
'''


def backend_plugin(name: str, priority: int = 10, extra: str = "") -> str:
    return BACKEND_PLUGIN.format(name=name, priority=priority, extra=extra)


def plugin_named(registry, name):  # type: ignore[no-untyped-def]
    return next(p for p in registry.plugins if p.name == name)


def test_builtins_register_through_the_hooks() -> None:
    registry = load_registry(entry_points=[])
    builtin = plugin_named(registry, "builtins")
    assert builtin.status == "active"
    assert "attention:torch_ref" in builtin.registers
    assert registry.lookup("attention", "torch_ref").distribution == "jackfield"
    assert {"murmur3", "torch_ref"} <= set(registry.names("sampler"))


def test_third_party_entry_point_is_listed_and_selected(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("acme-attn", "acme_attn", backend_plugin("acme"))
    registry = get_registry()
    info = plugin_named(registry, "acme_attn")
    assert (info.distribution, info.version, info.status) == ("acme-attn", "1.0", "active")
    assert info.registers == ["attention:acme"]
    assert registry.lookup("attention", "acme").distribution == "acme-attn"


def test_broken_plugin_is_reported_and_others_load(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("broken-plugin", "broken_plugin", "import not_a_real_module_xyz\n")
    make_dist("good-plugin", "good_plugin", backend_plugin("good"))
    registry = get_registry()
    broken = plugin_named(registry, "broken_plugin")
    assert broken.status == "failed"
    assert "not_a_real_module_xyz" in broken.reason
    assert registry.lookup("attention", "good")
    with pytest.raises(KeyError, match=r"(?s)broken_plugin.*failed.*not_a_real_module_xyz"):
        registry.lookup("attention", "what_broken_would_have_provided")


def test_hook_that_raises_is_a_failed_plugin(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("raising", "raising_plugin", '''
        import jackfield
        JACKFIELD_API = ">=1.0"
        @jackfield.hookimpl
        def register_samplers():
            raise RuntimeError("boom in hook")
        ''')
    info = plugin_named(get_registry(), "raising_plugin")
    assert info.status == "failed" and "boom in hook" in info.reason


def test_duplicate_name_names_both_distributions(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("dist-one", "plugin_one", backend_plugin("same"))
    make_dist("dist-two", "plugin_two", backend_plugin("same"))
    with pytest.raises(PluginConflictError, match=r"(?s)'same'.*dist-(one|two).*dist-(one|two)"):
        get_registry()


def test_duplicate_of_a_builtin_without_replaces_is_an_error(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("shadow", "shadow_plugin", backend_plugin("torch_ref"))
    with pytest.raises(PluginConflictError, match=r"(?s)jackfield.*shadow"):
        get_registry()


def test_replaces_is_explicit_and_recorded(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("better-ref", "better_ref", backend_plugin("torch_ref", extra=', replaces="torch_ref"'))
    registry = get_registry()
    assert registry.lookup("attention", "torch_ref").distribution == "better-ref"
    (old, new), = registry.replaced
    assert old.distribution == "jackfield" and new.distribution == "better-ref"


def test_replacing_a_missing_name_is_an_error(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("replacer", "replacer", backend_plugin("x", extra=', replaces="nope"'))
    with pytest.raises(PluginConflictError, match="replaces attention 'nope'"):
        get_registry()


@pytest.mark.parametrize(
    ("env", "value", "status", "reason"),
    [
        ("JACKFIELD_DISABLE_PLUGINS", "acme-attn", "disabled", "JACKFIELD_DISABLE_PLUGINS"),
        ("JACKFIELD_PLUGINS", "someone_else", "disabled", "not in JACKFIELD_PLUGINS"),
        ("JACKFIELD_PLUGINS", "acme_attn", "active", ""),
        ("JACKFIELD_DISABLE_PLUGIN_AUTOLOAD", "1", "disabled", "AUTOLOAD"),
    ],
)
def test_load_controls(make_dist, monkeypatch, env, value, status, reason) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(env, value)
    make_dist("acme-attn", "acme_attn", backend_plugin("acme"))
    registry = get_registry()
    info = plugin_named(registry, "acme_attn")
    assert info.status == status and reason in info.reason
    assert ("acme" in registry.names("attention")) == (status == "active")
    assert "torch_ref" in registry.names("attention")  # built-ins always load


@pytest.mark.parametrize(
    ("declared", "expected"),
    [("'>=2.0'", "supports core API >=2.0"), ("None", "declares no JACKFIELD_API"),
     ("'garbage!'", "not a version range")],
)
def test_incompatible_api_range_is_listed_not_loaded(make_dist, declared, expected) -> None:  # type: ignore[no-untyped-def]
    source = backend_plugin("future").replace('JACKFIELD_API = ">=1.0,<2"', f"JACKFIELD_API = {declared}")
    if declared == "None":
        source = source.replace("JACKFIELD_API = None", "")
    make_dist("future-plugin", "future_plugin", source)
    registry = get_registry()
    info = plugin_named(registry, "future_plugin")
    assert info.status == "incompatible" and expected in info.reason
    assert "future" not in registry.names("attention")


def test_loading_is_idempotent(make_dist) -> None:  # type: ignore[no-untyped-def]
    """Loading again (another process, a worker) gives the same plugins and records."""
    make_dist("acme-attn", "acme_attn", backend_plugin("acme"))
    first, second = load_registry(), load_registry()
    assert [(p.name, p.status, p.registers) for p in first.plugins] == [
        (p.name, p.status, p.registers) for p in second.plugins
    ]
    assert {k: {n: (e.spec, e.distribution) for n, e in t.items()} for k, t in first.entries.items()} == {
        k: {n: (e.spec, e.distribution) for n, e in t.items()} for k, t in second.entries.items()
    }
    assert "acme" in first.names("attention")
    assert get_registry() is get_registry()  # and the process-wide one is loaded once


def test_factory_strings_resolve_lazily_and_bad_ones_are_clear() -> None:
    assert resolve_factory("jackfield.plugins:load_registry") is load_registry
    with pytest.raises(ValueError, match="module:Attribute"):
        resolve_factory("no_colon_here")


def test_example_third_party_plugin_is_discovered(make_dist) -> None:  # type: ignore[no-untyped-def]
    """The shipped example package's real source, installed as a distribution."""
    repo = Path(__file__).resolve().parents[2]
    source = (repo / "examples/third_party_plugin/src/jackfield_example_plugin/__init__.py").read_text()
    make_dist("jackfield-example-plugin", "jackfield_example_plugin", source, ep_name="example")
    registry = get_registry()
    assert plugin_named(registry, "example").status == "active"
    entry = registry.lookup("sampler", "example_greedy")
    sampler = resolve_factory(entry.spec.factory)()
    import torch
    from jackfield.contracts.sampler import SamplingMetadata

    rows = 5
    metadata = SamplingMetadata(
        temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows),
        min_p=torch.zeros(rows), seeds=torch.arange(rows), positions=torch.arange(rows),
    )
    logits = torch.randn(rows, 33)
    logits[2] = float("-inf")
    out = sampler.sample(logits, metadata)
    assert torch.equal(out.token_ids[[0, 1, 3, 4]], logits[[0, 1, 3, 4]].argmax(-1))
    assert out.invalid_rows.tolist() == [False, False, True, False, False]


def test_cli_lists_a_third_party_plugin_in_a_fresh_process(make_dist) -> None:  # type: ignore[no-untyped-def]
    site = make_dist("acme-attn", "acme_attn", backend_plugin("acme"))
    result = subprocess.run(
        [sys.executable, "-m", "jackfield.cli", "plugins", "--json"],
        capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": str(site)}, check=True,
    )
    data = json.loads(result.stdout)
    assert data["schema"] == 1
    names = {b["name"]: b for b in data["attention_backends"]}
    assert names["acme"]["provider"] == "acme-attn" and names["acme"]["available"] is True
    assert any(p["name"] == "acme_attn" and p["status"] == "active" for p in data["plugins"])


ALL_HOOKS_PLUGIN = '''
import jackfield
from jackfield.builtins import TORCH_REF_CAPABILITIES
from jackfield.specs import AttentionBackendSpec, DrafterSpec, KVConnectorSpec, ModelSpec, SamplerSpec
JACKFIELD_API = ">=1.0,<2"

@jackfield.hookimpl
def register_attention_backends():
    return [AttentionBackendSpec(name="every_attn", factory="jackfield.attention.torch_ref:TorchRefBackend",
                                 capabilities=TORCH_REF_CAPABILITIES)]

@jackfield.hookimpl
def register_samplers():
    return [SamplerSpec(name="every_sampler", factory="jackfield.contracts.sampler:Sampler")]

@jackfield.hookimpl
def register_drafters():
    return [DrafterSpec(name="every_drafter", factory="jackfield.contracts.drafter:Drafter")]

@jackfield.hookimpl
def register_kv_connectors():
    return [KVConnectorSpec(name="every_connector",
                            factory="jackfield.contracts.kv_connector:KVConnectorWorker")]

@jackfield.hookimpl
def register_models():
    return [ModelSpec(name="EveryForCausalLM", factory="jackfield.contracts.attention:AttentionBackend")]
'''


def test_every_hook_registers_through_an_entry_point(make_dist) -> None:  # type: ignore[no-untyped-def]
    make_dist("every-hook", "every_hook", ALL_HOOKS_PLUGIN)
    registry = get_registry()
    info = plugin_named(registry, "every_hook")
    assert sorted(info.registers) == [
        "attention:every_attn", "drafter:every_drafter", "kv_connector:every_connector",
        "model:EveryForCausalLM", "sampler:every_sampler",
    ]
    for kind, name in (r.split(":") for r in info.registers):
        entry = registry.lookup(kind, name)
        assert entry.distribution == "every-hook"
        assert isinstance(resolve_factory(entry.spec.factory), type)
