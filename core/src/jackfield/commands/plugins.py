"""`jackfield plugins [--json]`: what is installed, what it registers, what works here.

JSON schema (version 1), stable:
{"schema": 1, "core": {"version": str, "api": str},
 "plugins": [{"name", "distribution", "version", "status": "active|failed|disabled|incompatible",
              "reason": str, "registers": ["kind:name", ...]}],
 "attention_backends": [{"name", "provider", "priority", "available": bool, "reason": str,
                         "capabilities": {field: value}}],
 "samplers" | "drafters" | "kv_connectors" | "models": [{"name", "provider", "description"}],
 "replaced": [{"kind", "name", "by"}]}
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from jackfield import __version__
from jackfield.plugins import API_VERSION, Registered, Registry, get_registry
from jackfield.selection import run_probe
from jackfield.specs import AttentionBackendSpec

SCHEMA_VERSION = 1
_LISTS = {"sampler": "samplers", "drafter": "drafters", "kv_connector": "kv_connectors", "model": "models"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plugins", help="list installed plugins and backends")
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    parser.set_defaults(handler=main)


def _jsonable(value: object) -> object:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple | list | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)  # a plugin's own value type still lists, as text


def _attention_row(entry: Registered) -> dict[str, object]:
    spec = entry.spec
    assert isinstance(spec, AttentionBackendSpec)
    probe = run_probe(spec)  # a crashing probe is "unavailable", with the crash as the reason
    available, reason = probe.ok is True, str(probe.reason)
    caps = {f.name: _jsonable(getattr(spec.capabilities, f.name))
            for f in dataclasses.fields(spec.capabilities)}
    return {
        "name": spec.name,
        "provider": entry.distribution,
        "priority": spec.priority,
        "available": available,
        "reason": reason,
        "capabilities": caps,
    }


def report(registry: Registry) -> dict[str, object]:
    data: dict[str, object] = {
        "schema": SCHEMA_VERSION,
        "core": {"version": __version__, "api": API_VERSION},
        "plugins": [dataclasses.asdict(info) for info in registry.plugins],
        "attention_backends": [_attention_row(e) for _, e in sorted(registry.entries["attention"].items())],
        "replaced": [
            {"kind": old.kind, "name": old.spec.name, "by": f"{new.spec.name} ({new.distribution})"}
            for old, new in registry.replaced
        ],
    }
    for kind, key in _LISTS.items():
        data[key] = [
            {"name": name, "provider": e.distribution, "description": e.spec.description}
            for name, e in sorted(registry.entries[kind].items())
        ]
    return data


def _print_text(data: dict[str, object]) -> None:
    core = data["core"]
    print(f"jackfield {core['version']} (plugin API {core['api']})")  # type: ignore[index]
    print("\nplugins:")
    for p in data["plugins"]:  # type: ignore[attr-defined]
        extra = f" - {p['reason']}" if p["reason"] else ""
        print(f"  {p['name']:<16} {p['distribution']} {p['version']:<10} [{p['status']}]{extra}")
        if p["registers"]:
            print(f"      registers: {', '.join(p['registers'])}")
    print("\nattention backends:")
    for b in data["attention_backends"]:  # type: ignore[attr-defined]
        caps = b["capabilities"]
        flags = [f for f in ("sliding_window", "sinks", "sparse_topk", "non_causal", "dcp") if caps[f]]
        state = "available" if b["available"] else "UNAVAILABLE"
        print(f"  {b['name']:<16} ({b['provider']}, priority {b['priority']}) {state}: {b['reason']}")
        print(
            f"      kinds={','.join(caps['kinds'])} dtypes={','.join(caps['activation_dtypes'])} "
            f"kv_cache={','.join(caps['kv_cache_dtypes'])} block_size%{caps['block_size_multiple']} "
            f"devices={','.join(caps['devices'])} max_decode_q={caps['max_decode_query_len']} "
            f"features={','.join(flags) or '-'}"
        )
    for key in _LISTS.values():
        print(f"\n{key.replace('_', ' ')}:")
        rows = data[key] or [{"name": "(none)", "provider": "", "description": ""}]  # type: ignore[operator]
        for row in rows:  # type: ignore[union-attr]
            print(f"  {row['name']:<24} {row['provider']:<22} {row['description']}")
    for r in data["replaced"]:  # type: ignore[attr-defined]
        print(f"\nnote: {r['kind']} {r['name']!r} is replaced by {r['by']}")


def main(args: argparse.Namespace) -> int:
    data = report(get_registry())
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_text(data)
    return 0
