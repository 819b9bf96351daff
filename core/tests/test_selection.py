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


@pytest.mark.parametrize(
    ("decode", "prefill", "want"),
    [
        ((16, 64), (16, 64), 64),  # cuda_mla both roles: its preferred 64-key pages
        ((1, None), (1, None), 16),  # torch_ref: vLLM's default
        ((1, None), (16, 64), 64),  # decode has no preference: the prefill backend's
        ((16, 48), (32, None), 32),  # 48 and 16 break prefill's multiple of 32: the smallest both allow
        ((16, 64), (128, None), 128),  # a preferred size below the other role's multiple is not taken
    ],
)
def test_block_size_left_open_takes_a_preferred_size_both_roles_allow(
    decode: tuple[int, int | None], prefill: tuple[int, int | None], want: int
) -> None:
    from jackfield.attention.torch_ref import TorchRefBackend
    from jackfield.selection import pick_block_size

    def backend(multiple: int, preferred: int | None) -> type[TorchRefBackend]:
        caps = dataclasses.replace(TorchRefBackend.capabilities, block_size_multiple=multiple,
                                   preferred_block_size=preferred)
        return type("Fake", (TorchRefBackend,), {"capabilities": caps})

    size = pick_block_size(backend(*decode), backend(*prefill))
    assert size == want
    assert size % decode[0] == 0 and size % prefill[0] == 0


def test_an_unset_block_size_passes_capability_checks_and_a_set_one_is_checked() -> None:
    from jackfield.builtins import TORCH_REF_CAPABILITIES

    caps = dataclasses.replace(TORCH_REF_CAPABILITIES, block_size_multiple=64)
    assert capability_mismatches(caps, dataclasses.replace(MLA, block_size=None)) == []
    assert any("multiple of 64" in r for r in capability_mismatches(caps, MLA))


def test_validate_asks_supports_non_causal_for_every_decode_query_length() -> None:
    """A backend whose non-causal answer depends on the cache dtype and query length (a per-arch
    kernel list) is refused for exactly the lengths up to the requirement's longest it lacks."""
    from jackfield.attention.torch_ref import TorchRefBackend

    class LacksTwoRowFp8(TorchRefBackend):
        @classmethod
        def supports_non_causal(cls, device: object, kv_cache_dtype: str = "auto",
                                query_len: int = 1) -> bool:
            return not (kv_cache_dtype == "fp8_e4m3" and query_len == 2)

    req = dataclasses.replace(MLA, non_causal=True, max_decode_query_len=4, kv_cache_dtype="fp8_e4m3")
    assert LacksTwoRowFp8.validate(req) == [
        "non_causal not supported on cpu with kv_cache_dtype 'fp8_e4m3' for decode query lengths [2]"
    ]
    assert LacksTwoRowFp8.validate(dataclasses.replace(req, max_decode_query_len=1)) == []
    assert LacksTwoRowFp8.validate(dataclasses.replace(req, kv_cache_dtype="auto")) == []
    assert LacksTwoRowFp8.validate(dataclasses.replace(req, non_causal=False)) == []
