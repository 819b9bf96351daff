"""The emulator itself: its float64 attention is the oracle's (jackfield.ops.reference), and it
refuses what AITER refuses; and broken variants of the backend fail the conformance kit through it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from jackfield.ops.reference import paged_attention
from jackfield.testing.harness import Case
from jackfield_rocm_aiter import layout as layout_module
from jackfield_rocm_aiter.backend import RocmAiterMLAImpl

from . import test_conformance  # the module, not its classes: pytest would collect them here too
from .aiter_emulator import EmulatedAbort, EmulatedAiter
from .emulated import emulated_backend


def page_size_one_call(q_lens: list[int], seq_lens: list[int], gen: torch.Generator):  # type: ignore[no-untyped-def]
    """A uniform decode batch laid out for AITER by hand: each request's keys are consecutive
    random slots of a [slots, 1, 1, 576] cache."""
    num_slots = sum(seq_lens) + 7
    cache = torch.randn(num_slots, 1, 1, 576, generator=gen).to(torch.bfloat16)
    kv_indices = torch.randperm(num_slots, generator=gen)[: sum(seq_lens)].to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 16, 576, generator=gen).to(torch.bfloat16)
    return q, cache, qo_indptr, kv_indptr, kv_indices, torch.ones(len(q_lens), dtype=torch.int32)


@pytest.mark.parametrize("fp8, causal", [(False, True), (True, False)], ids=["bf16-causal", "fp8-non-causal"])
def test_the_emulator_attends_as_the_oracle(fp8: bool, causal: bool, gen: torch.Generator) -> None:
    """gfx950 has a causal bf16 and a non-causal fp8 kernel for 16 heads and 4 rows; fp8 values
    are multiplied by their scales."""
    aiter = EmulatedAiter("gfx950")
    q, cache, qo_indptr, kv_indptr, kv_indices, last = page_size_one_call([4, 4], [4, 13], gen)
    scales = {"q_scale": torch.tensor([0.5]), "kv_scale": torch.tensor([0.25])} if fp8 else {}
    if fp8:
        q, cache = q.to(aiter.fp8), cache.to(aiter.fp8)
    o = torch.empty(8, 16, 512, dtype=torch.bfloat16)
    _, lse = aiter.mla_decode_fwd(q, cache, o, qo_indptr, kv_indptr, kv_indices, last, 4, sm_scale=0.1,
                                  return_lse=True, causal=causal, **scales)
    # the cache as blocks of one token, one kv head; request b's block table lists its slots
    block_table = torch.zeros(2, 13, dtype=torch.int32)
    block_table[0, :4], block_table[1] = kv_indices[:4], kv_indices[4:]
    q_values = q.double() * (0.5 if fp8 else 1.0)
    want, want_lse = paged_attention(q_values, cache, cache[..., :512], block_table, torch.tensor([4, 13]),
                                     qo_indptr, 0.1, causal=causal, kv_scale=0.25 if fp8 else None)
    torch.testing.assert_close(o.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)
    assert lse is not None
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)


def test_the_emulator_refuses_what_aiter_refuses(gen: torch.Generator) -> None:
    aiter = EmulatedAiter("gfx942")
    q, cache, qo_indptr, kv_indptr, kv_indices, last = page_size_one_call([2, 2], [4, 5], gen)
    o = torch.empty(4, 16, 512, dtype=torch.bfloat16)
    args = (cache, o, qo_indptr, kv_indptr, kv_indices, last, 2)
    with pytest.raises(EmulatedAbort, match="cannot get heuristic kernel"):  # no non-causal kernel on gfx942
        aiter.mla_decode_fwd(q, *args, causal=False)
    with pytest.raises(EmulatedAbort, match="fp8 Q requires q_scale and kv_scale"):
        aiter.mla_decode_fwd(q.to(aiter.fp8), cache.to(aiter.fp8), *args[1:])
    with pytest.raises(EmulatedAbort, match="unsupport Q dtype"):
        aiter.mla_decode_fwd(q.float(), *args)
    with pytest.raises(EmulatedAbort, match="is_contiguous"):
        aiter.mla_decode_fwd(q.transpose(0, 1).contiguous().transpose(0, 1), *args)
    with pytest.raises(AssertionError, match="not uniform"):
        aiter.mla_decode_fwd(q[:3], cache, o[:3], torch.tensor([0, 2, 3], dtype=torch.int32), *args[3:])
    with pytest.raises(AssertionError, match="logit_cap"):
        aiter.mla_decode_fwd(q, *args, logit_cap=30.0)
    aiter.mla_decode_fwd(q, *args)  # the causal kernel exists
    assert [call.kernel for call in aiter.calls] == ["_ZN5aiter39mla_a16w16_qh16_m16x4_n16x1_coex0_mask1E"]


class IgnoresNonCausal(RocmAiterMLAImpl):
    def attend(self, query, kv_cache, metadata, **kw):  # type: ignore[no-untyped-def]
        return super().attend(query, kv_cache, metadata.replace(causal=True), **kw)


def own_rows_first(metadata):  # type: ignore[no-untyped-def]
    """The layout with each request's rows at the start of its padded block (the mask aligns them
    at the end)."""
    layout = real_build_layout(metadata)
    if layout.padded_rows is None:
        return layout
    q_lens = metadata.query_start_loc.diff().long()
    req = torch.repeat_interleave(torch.arange(metadata.num_reqs), q_lens)
    rows = req * layout.query_len + torch.arange(req.numel()) - metadata.query_start_loc[req].long()
    return dataclasses.replace(layout, padded_rows=rows)


real_build_layout = layout_module.build_layout


@pytest.mark.parametrize("broken", ["ignores non-causal", "own rows first"])
def test_broken_variants_fail_the_kit(
    broken: str, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    backend = emulated_backend(EmulatedAiter("gfx950"))
    if broken == "ignores non-causal":
        monkeypatch.setattr(backend, "make_impl", classmethod(lambda cls, layer: IgnoresNonCausal(
            layer, cls.platform_probe().platform)))
        case = Case("mla", torch.bfloat16, "fp8_e4m3", "non_causal")
    else:
        monkeypatch.setattr(layout_module, "build_layout", own_rows_first)
        case = Case("mla", torch.bfloat16, "auto", "causal")
    with pytest.raises(AssertionError):  # the kit's multi-token decodes are ragged: padding is exercised
        test_conformance.TestGfx950().test_attend_matches_reference(backend, case, gen)
