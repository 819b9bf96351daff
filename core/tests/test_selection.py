"""Backend selection: explicit names are hard requirements; auto lists every rejection."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from jackfield.config import load_config
from jackfield.contracts.attention import AttentionRequirements, Availability, capability_mismatches
from jackfield.plugins import Registered, load_registry
from jackfield.selection import SelectionError, resolve_attention, select_attention_backend
from jackfield.specs import AttentionBackendSpec

MLA = AttentionRequirements(kind="mla", dtype=torch.float32, head_size=576, block_size=16, device="cpu")


def registry_with(*specs: AttentionBackendSpec):  # type: ignore[no-untyped-def]
    registry = load_registry(entry_points=[])
    for spec in specs:
        registry.entries["attention"][spec.name] = Registered("attention", spec, "test", "test-dist")
    return registry


def fake_backend(name: str, priority: int, ok: bool = True, **caps: object) -> AttentionBackendSpec:
    from jackfield.builtins import TORCH_REF_CAPABILITIES

    return AttentionBackendSpec(
        name=name,
        factory="jackfield.attention.torch_ref:TorchRefBackend",
        capabilities=dataclasses.replace(TORCH_REF_CAPABILITIES, **caps),
        availability=(lambda: Availability.yes()) if ok else (lambda: Availability.no("no GPU here")),
        priority=priority,
    )


def test_capability_mismatches_lists_every_reason() -> None:
    from jackfield.builtins import TORCH_REF_CAPABILITIES

    caps = dataclasses.replace(
        TORCH_REF_CAPABILITIES, kinds=("mha",), activation_dtypes=(torch.bfloat16,), block_size_multiple=64,
        devices=("cuda",), sparse_topk=False, max_decode_query_len=1, head_sizes=(128,),
    )
    req = dataclasses.replace(MLA, sparse_topk=True, max_decode_query_len=2)
    reasons = capability_mismatches(caps, req)
    for fragment in ("kind 'mla'", "float32", "head size 576", "multiple of 64", "device 'cpu'",
                     "sparse_topk", "decode query length 2"):
        assert any(fragment in r for r in reasons), (fragment, reasons)
    assert capability_mismatches(TORCH_REF_CAPABILITIES, MLA) == []


def test_auto_picks_highest_priority_valid_and_records_rejections() -> None:
    registry = registry_with(
        fake_backend("fast_gpu", 100, ok=False),
        fake_backend("mid", 50, kinds=("mha",)),
        fake_backend("low", 10),
    )
    choice = select_attention_backend(MLA, "auto", registry=registry)
    assert choice.name == "low"
    assert "priority 10" in choice.reason
    assert choice.rejected["fast_gpu"] == ["unavailable: no GPU here"]
    assert any("kind 'mla'" in r for r in choice.rejected["mid"])


def test_explicit_unavailable_backend_lists_reasons_and_alternatives() -> None:
    registry = registry_with(fake_backend("fast_gpu", 100, ok=False, block_size_multiple=64))
    with pytest.raises(SelectionError) as info:
        select_attention_backend(MLA, "fast_gpu", registry=registry)
    message = str(info.value)
    assert "unavailable: no GPU here" in message
    assert "multiple of 64" in message
    assert "would work: torch_ref" in message


def test_explicit_unknown_backend_lists_registered_names() -> None:
    with pytest.raises(SelectionError, match=r"(?s)'nope'.*registered: torch_ref"):
        select_attention_backend(MLA, "nope", registry=registry_with())


def test_explicit_torch_ref_is_taken() -> None:
    choice = select_attention_backend(MLA, "torch_ref", registry=registry_with())
    assert choice.name == "torch_ref" and choice.reason == "named in the config"
    assert choice.backend.name == "torch_ref"


def test_nothing_valid_is_an_error_with_every_backend() -> None:
    req = dataclasses.replace(MLA, device="tpu")
    with pytest.raises(SelectionError, match=r"(?s)no installed attention backend.*torch_ref: device 'tpu'"):
        select_attention_backend(req, registry=registry_with())


def test_resolve_attention_per_role_reports_all_roles() -> None:
    config = load_config(None, {"attention.prefill_backend": "missing_a",
                                "attention.decode_backend": "missing_b"})
    with pytest.raises(SelectionError) as info:
        resolve_attention(config, MLA)
    assert "prefill" in str(info.value) and "decode" in str(info.value)
    config = load_config(None, {"attention.backend": "torch_ref"})
    roles = resolve_attention(config, MLA)
    assert {role: c.name for role, c in roles.items()} == {"prefill": "torch_ref", "decode": "torch_ref"}
