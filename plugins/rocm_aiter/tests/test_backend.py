"""rocm_aiter_mla as selection, `jackfield plugins` and a model layer see it: what it answers per
arch and AITER release (the emulator), what it refuses before AITER could abort, and the fp8 path
against a float64 reference of the same quantized query."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from jackfield.cli import main
from jackfield.contracts.attention import AttentionRequirements
from jackfield.ops.reference import paged_attention
from jackfield.plugins import Registered, load_registry
from jackfield.selection import SelectionError, select_attention_backend
from jackfield.specs import AttentionBackendSpec
from jackfield.testing.harness import ConformanceHarness
from jackfield.testing.problems import make_batch, mla_layer, poisoned_cache, random_kv
from jackfield_rocm_aiter.backend import RocmAiterMLABackend
from jackfield_rocm_aiter.platform import probe_platform

from .aiter_emulator import EmulatedAiter, EmulatedAiterWithoutCausal
from .emulated import emulated_backend

MLA = AttentionRequirements(kind="mla", dtype=torch.bfloat16, head_size=576, block_size=16, device="cpu")


def layer(num_heads: int = 16, kv_cache_dtype: str = "auto"):  # type: ignore[no-untyped-def]
    return mla_layer(num_heads, 512, 64, 128, 128, kv_cache_dtype)  # type: ignore[arg-type]


def registry_with(backend: type[RocmAiterMLABackend]):  # type: ignore[no-untyped-def]
    """The registry of this machine's plugins, rocm_aiter_mla's record replaced by `backend`'s."""
    spec = AttentionBackendSpec(name="rocm_aiter_mla", factory=backend, capabilities=backend.capabilities,
                                availability=backend.availability, priority=60)
    registry = load_registry(entry_points=[])
    registry.entries["attention"]["rocm_aiter_mla"] = Registered("attention", spec, "rocm_aiter",
                                                                 "jackfield-rocm-aiter")
    return registry


def test_jackfield_plugins_lists_it_with_the_probe_s_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["attention_backends"]}
    row, probe = rows["rocm_aiter_mla"], probe_platform()
    assert (row["provider"], row["priority"]) == ("jackfield-rocm-aiter", 60)
    assert (row["available"], row["reason"]) == (probe.platform is not None, probe.reason)
    if torch.version.hip is None:  # CI and this repository's machines: a CPU or CUDA PyTorch
        assert not row["available"]
        assert row["reason"] == "not a ROCm build of PyTorch (torch.version.hip is None)"
    assert main(["plugins"]) == 0
    state = "available" if row["available"] else "UNAVAILABLE"
    line = f"rocm_aiter_mla   (jackfield-rocm-aiter, priority 60) {state}: {row['reason']}"
    assert line in capsys.readouterr().out


def test_selection_picks_it_where_aiter_runs() -> None:
    registry = registry_with(emulated_backend(EmulatedAiter("gfx950")))
    choice = select_attention_backend(MLA, "auto", registry=registry)
    assert choice.name == "rocm_aiter_mla" and "priority 60" in choice.reason
    assert choice.rejected == {}


@pytest.mark.parametrize(
    ("arch", "aiter_release", "change", "reasons"),
    [
        ("gfx950", EmulatedAiter, {"dtype": torch.float16}, ["activation dtype float16 not in [bfloat16]"]),
        ("gfx950", EmulatedAiter, {"sliding_window": True}, ["sliding_window not supported"]),
        ("gfx950", EmulatedAiter, {"max_decode_query_len": 5},
         ["decode query length 5 exceeds the backend's 4"]),
        ("gfx942", EmulatedAiter, {"kv_cache_dtype": "fp8_e4m3"},
         ["AITER's fp8 kernels on gfx942 read torch.float8_e4m3fnuz, but a fp8_e4m3 KV cache holds "
          "torch.float8_e4m3fn"]),
        ("gfx942", EmulatedAiter, {"non_causal": True, "max_decode_query_len": 2},
         ["lists no decode kernel for bf16 queries over a bf16 cache, 16 heads, 2 query rows per "
          "request, non-causal", "128 heads, 2 query rows per request, non-causal"]),
        ("gfx950", EmulatedAiter,
         {"non_causal": True, "max_decode_query_len": 4, "kv_cache_dtype": "fp8_e4m3"},
         ["AITER's gfx950 manifest", "lists no decode kernel for fp8 queries over a fp8 cache, 16 heads, "
          "2 query rows per request, non-causal (qType=fp8, kvType=fp8, Gqa=16, ps=0, qSeqLen=2, "
          "prefill=0, causal=0"]),
        ("gfx950", EmulatedAiterWithoutCausal,
         {"non_causal": True, "max_decode_query_len": 4, "kv_cache_dtype": "fp8_e4m3"},
         ["the installed aiter.mla.mla_decode_fwd has no `causal` parameter (causal only)"]),
    ],
    ids=["float16", "window", "five-rows", "gfx942-fp8", "gfx942-non-causal", "gfx950-fp8-two-rows",
         "aiter-without-causal"],
)
def test_selection_rejects_it_with_the_reason(
    arch: str, aiter_release: type[EmulatedAiter], change: dict[str, object], reasons: list[str]
) -> None:
    """An explicit choice lists every reason; `auto` falls back to torch_ref and records them."""
    registry = registry_with(emulated_backend(aiter_release(arch)))
    req = dataclasses.replace(MLA, **change)  # type: ignore[arg-type]
    with pytest.raises(SelectionError) as info:
        select_attention_backend(req, "rocm_aiter_mla", registry=registry)
    for reason in reasons:
        assert reason in str(info.value), (reason, str(info.value))
    assert select_attention_backend(req, "auto", registry=registry).name == "torch_ref"


def test_the_fp8_refusal_of_gfx950_is_the_two_row_kernel_alone() -> None:
    """Every reason names the one missing kernel: 16 heads, 2 rows, non-causal."""
    backend = emulated_backend(EmulatedAiter("gfx950"))
    req = dataclasses.replace(MLA, non_causal=True, max_decode_query_len=4, kv_cache_dtype="fp8_e4m3")
    reasons = backend.validate(req)
    assert len(reasons) == 1 and "16 heads, 2 query rows" in reasons[0], reasons


@pytest.mark.parametrize(
    ("arch", "aiter_release", "kv_cache_dtype", "lengths"),
    [
        ("gfx950", EmulatedAiter, "fp8_e4m3", [1, 3, 4]),
        ("gfx950", EmulatedAiter, "auto", [1]),
        ("gfx950", EmulatedAiterWithoutCausal, "fp8_e4m3", [1]),
        ("gfx942", EmulatedAiter, "bfloat16", [1]),
        ("gfx942", EmulatedAiter, "fp8_e4m3", []),  # AITER reads fp8 as e4m3fnuz there
    ],
)
def test_supports_non_causal_per_cache_and_query_length(
    arch: str, aiter_release: type[EmulatedAiter], kv_cache_dtype: str, lengths: list[int]
) -> None:
    backend = emulated_backend(aiter_release(arch))
    served = [q for q in range(1, 5) if backend.supports_non_causal("cpu", kv_cache_dtype, q)]  # type: ignore[arg-type]
    assert served == lengths
    assert not backend.supports_non_causal("cuda", kv_cache_dtype, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"num_heads": 32}, "32 heads (AITER's MLA decode: (16, 128))"),
        ({"kv_lora_rank": 256, "head_size": 320}, "kv_lora_rank 256 + rope 64"),
        ({"sliding_window": 128}, "sliding window 128"),
    ],
)
def test_make_impl_refuses_layers_aiter_cannot_serve(changes: dict[str, int], problem: str) -> None:
    backend = emulated_backend(EmulatedAiter("gfx950"))
    with pytest.raises(ValueError, match="rocm_aiter_mla cannot serve this layer") as info:
        backend.make_impl(dataclasses.replace(layer(), **changes))
    assert problem in str(info.value)


def attend_problem(  # type: ignore[no-untyped-def]
    backend: type[RocmAiterMLABackend], heads: int, kv_cache_dtype: str, q_lens: list[int],
    seq_lens: list[int], causal: bool, gen: torch.Generator,
):
    """An impl and a filled cache for one decode batch, and a bf16 latent query."""
    lay = layer(heads, kv_cache_dtype)
    impl = backend.make_impl(lay)
    batch = make_batch(q_lens, seq_lens, len(q_lens), 16, "cpu", gen, causal=causal)
    cache = poisoned_cache(lay, batch, torch.bfloat16, "cpu")
    slots = torch.cat([batch.context_slots, batch.metadata.slot_mapping])
    kv_scale = ConformanceHarness().kv_scale(lay)
    impl.write_kv(cache, slots, *random_kv(lay, slots.numel(), torch.bfloat16, "cpu", gen), kv_scale)
    query = torch.randn(batch.num_tokens, heads, 576, generator=gen).to(torch.bfloat16)
    return impl, batch.metadata, cache, query, kv_scale


def test_a_batch_without_a_kernel_is_refused_before_aiter_is_called(gen: torch.Generator) -> None:
    """fp8, non-causal, 2 rows: gfx950 has the kernel for 128 heads, not for 16."""
    aiter = EmulatedAiter("gfx950")
    backend = emulated_backend(aiter)
    impl, md, cache, query, kv_scale = attend_problem(backend, 16, "fp8_e4m3", [2, 2], [5, 9], False, gen)
    with pytest.raises(ValueError, match=r"AITER cannot run this decode batch: .*16 heads, 2 query rows"):
        impl.attend(query, cache, md, kv_scale=kv_scale)
    assert aiter.calls == []
    impl, md, cache, query, kv_scale = attend_problem(backend, 128, "fp8_e4m3", [2, 2], [5, 9], False, gen)
    impl.attend(query, cache, md, kv_scale=kv_scale)
    msk0 = "_ZN5aiter31mla_a8w8_qh128_m32x4_n16x2_msk0E"
    assert [(c.kernel, c.causal) for c in aiter.calls] == [(msk0, False)]


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_decode_is_the_attention_of_the_fp8_query(causal: bool, gen: torch.Generator) -> None:
    """Over an fp8 cache the query goes to AITER as fp8 with a per-tensor scale: the output is the
    float64 attention of that quantized query over the dequantized cache, to bf16 rounding (and a
    request shorter than the batch's longest, padded)."""
    backend = emulated_backend(EmulatedAiter("gfx950"))
    impl, md, cache, query, kv_scale = attend_problem(backend, 16, "fp8_e4m3", [4, 3], [4, 11], causal, gen)
    got = impl.attend(query, cache, md, kv_scale=kv_scale, return_lse=True)
    q_scale = query.float().abs().max() / 448.0
    q_fp8 = (query.float() / q_scale).to(torch.float8_e4m3fn).double() * q_scale.double()
    want, want_lse = paged_attention(
        q_fp8, cache[:, :, None], cache[:, :, None, :512], md.block_table, md.seq_lens, md.query_start_loc,
        impl.layer.scale, causal=causal, kv_scale=kv_scale.double(),
    )
    torch.testing.assert_close(got.out.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)
    assert got.lse is not None and got.lse.dtype == torch.float32
    torch.testing.assert_close(got.lse.double(), want_lse, atol=1e-5, rtol=1e-5)
