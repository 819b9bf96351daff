"""`AttentionConformance`: the test class a backend author subclasses to be held to torch_ref.

    from jackfield.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        backend_name = "my_mla"   # looked up in the plugin registry, or set backend_cls
        device = "cuda"
        dtype = torch.bfloat16

Each feature is tested only where the backend's capabilities claim it; what they do not claim must
be rejected by `validate()` with a reason naming the feature. Caches start NaN-poisoned, so reading
a slot the metadata does not own shows up as NaN. Shapes are small enough for CPU; override the
class attributes (e.g. kv_lora_rank = 512, qk_rope_head_dim = 64) to match a kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jackfield.attention.metadata import GroupMetadataBuilder
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionRequirements,
    KVCacheDType,
)
from jackfield.testing import checks
from jackfield.testing.harness import ConformanceHarness
from jackfield.testing.problems import make_batch, poisoned_cache, query_width, random_kv, sparse_topk


class AttentionConformance(ConformanceHarness):
    def base_kv_dtype(self, backend: type[AttentionBackend]) -> KVCacheDType:
        dtypes = backend.capabilities.kv_cache_dtypes
        return "auto" if "auto" in dtypes else dtypes[0]

    def requirements(self, backend: type[AttentionBackend], kind: str) -> AttentionRequirements:
        return AttentionRequirements(
            kind=kind,  # type: ignore[arg-type]
            dtype=self.dtype,
            head_size=self.layer(kind).head_size,
            block_size=self.block_size_list(backend)[0],
            device=torch.device(self.device).type,
            kv_cache_dtype=self.base_kv_dtype(backend),
        )

    # ---- capabilities ----------------------------------------------------------------------
    def test_validate_accepts_the_baseline(self, backend: type[AttentionBackend], kind: str) -> None:
        assert backend.validate(self.requirements(backend, kind)) == []

    def test_validate_rejects_what_capabilities_do_not_claim(
        self, backend: type[AttentionBackend], kind: str
    ) -> None:
        caps, base = backend.capabilities, self.requirements(backend, kind)
        cases: list[tuple[dict[str, object], str]] = [
            ({feature: True}, feature)
            for feature in ("sliding_window", "sinks", "sparse_topk", "non_causal", "dcp")
            if not getattr(caps, feature)
        ]
        cases += [
            ({"max_decode_query_len": caps.max_decode_query_len + 1}, "decode query length"),
            ({"dtype": torch.float64}, "dtype"),
            ({"device": "meta"}, "device"),
        ]
        if "fp8_e4m3" not in caps.kv_cache_dtypes:
            cases.append(({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype"))
        other_kind = "mha" if kind == "mla" else "mla"
        if other_kind not in caps.kinds:
            cases.append(({"kind": other_kind}, "kind"))
        if caps.block_size_multiple > 1:
            cases.append(({"block_size": caps.block_size_multiple + 1}, "block size"))
        if caps.head_sizes is not None:
            cases.append(({"head_size": max(caps.head_sizes) + 1}, "head size"))
        for change, word in cases:
            reasons = backend.validate(dataclasses.replace(base, **change))
            assert any(word in r for r in reasons), (
                f"validate({change}) gave {reasons}, none mentions {word!r}"
            )

    # ---- KV writes ---------------------------------------------------------------------------
    def test_write_kv_matches_reference(
        self, backend: type[AttentionBackend], kind: str, gen: torch.Generator
    ) -> None:
        for kv_dtype in backend.capabilities.kv_cache_dtypes:
            layer = self.layer(kind, kv_dtype)
            impl, ref = self.impls(backend, layer, gen)
            bs = self.block_size_list(backend)[0]
            batch = make_batch([1, 3, 7], [5, 3 * bs + 1, 9], 1, bs, self.device, gen)
            slots = batch.metadata.slot_mapping.clone()
            slots[torch.randperm(slots.numel(), generator=gen)[:3].to(slots.device)] = -1  # padding rows
            key, value = random_kv(layer, batch.num_tokens, self.dtype, self.device, gen)
            kv_scale = self.kv_scale(kv_dtype)
            got, want = (
                poisoned_cache(layer, batch, self.dtype, self.device),
                poisoned_cache(layer, batch, self.dtype, self.device),
            )
            impl.write_kv(got, slots, key, value, kv_scale)
            ref.write_kv(want, slots, key, value, kv_scale)
            checks.assert_cache_close(got, want, kv_scale, f"write_kv, kv_cache_dtype={kv_dtype}")

    # ---- attend --------------------------------------------------------------------------------
    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
    def test_attend_matches_reference(
        self, backend: type[AttentionBackend], kind: str, causal: bool, gen: torch.Generator
    ) -> None:
        if not causal and not (backend.capabilities.non_causal and backend.supports_non_causal(self.device)):
            pytest.skip("non-causal attention not supported")
        layer = self.layer(kind, self.base_kv_dtype(backend))
        for what, batch in self.batches(backend, kind, gen, causal=causal):
            self.check_attend(backend, layer, batch, gen, what=what)

    def test_attend_fp8_cache(self, backend: type[AttentionBackend], kind: str, gen: torch.Generator) -> None:
        if "fp8_e4m3" not in backend.capabilities.kv_cache_dtypes:
            pytest.skip("fp8_e4m3 cache not supported")
        layer = self.layer(kind, "fp8_e4m3")
        for what, batch in self.batches(backend, kind, gen):
            self.check_attend(backend, layer, batch, gen, what=f"fp8 cache, {what}")

    @pytest.mark.parametrize("window", [1, 5])
    def test_attend_sliding_window(
        self, backend: type[AttentionBackend], kind: str, window: int, gen: torch.Generator
    ) -> None:
        if not backend.capabilities.sliding_window:
            pytest.skip("sliding window not supported")
        layer = self.layer(kind, self.base_kv_dtype(backend), sliding_window=window)
        for what, batch in self.batches(backend, kind, gen):
            self.check_attend(backend, layer, batch, gen, what=f"window {window}, {what}")

    def test_attend_sinks(self, backend: type[AttentionBackend], kind: str, gen: torch.Generator) -> None:
        if not backend.capabilities.sinks:
            pytest.skip("sinks not supported")
        layer = self.layer(kind, self.base_kv_dtype(backend))
        sinks = torch.randn(layer.num_heads, generator=gen).to(self.device)
        for what, batch in self.batches(backend, kind, gen):
            self.check_attend(backend, layer, batch, gen, what=f"sinks, {what}", sinks=sinks)

    def test_attend_sparse_topk(
        self, backend: type[AttentionBackend], kind: str, gen: torch.Generator
    ) -> None:
        if not backend.capabilities.sparse_topk:
            pytest.skip("sparse top-k not supported")
        layer = self.layer(kind, self.base_kv_dtype(backend))
        for bs in self.block_size_list(backend):
            q_lens, seq_lens = [1, 1, 3, 6], [2 * bs + 1, 4, 3 + bs, 6]
            batch = make_batch(q_lens, seq_lens, 2, bs, self.device, gen)
            self.check_attend(backend, layer, batch, gen, what=f"sparse top-k, block_size={bs}", topk=8)

    # ---- forward (write + attend, the batch divided by role as the engine divides it) -----------
    @pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
    def test_forward_matches_reference(
        self, backend: type[AttentionBackend], kind: str, sparse: bool, gen: torch.Generator
    ) -> None:
        caps = backend.capabilities
        if sparse and not (kind == "mla" and caps.sparse_topk):
            pytest.skip("sparse forward is an MLA feature the backend does not claim")
        max_q = min(caps.max_decode_query_len, 3)
        for kv_dtype in {
            self.base_kv_dtype(backend),
            *(["fp8_e4m3"] if "fp8_e4m3" in caps.kv_cache_dtypes else []),
        }:
            layer = self.layer(kind, kv_dtype)
            impl, ref = self.impls(backend, layer, gen)
            bs = self.block_size_list(backend)[0]
            q_lens = [max_q, 1, 5, 9]  # two decodes, then a fresh prefill and a chunked one
            batch = make_batch(q_lens, [max_q + 2 * bs, 3, 5, 9 + bs + 3], 2, bs, self.device, gen)
            kv_scale = self.kv_scale(kv_dtype)
            got_cache, new_kv = self.filled(layer, batch, kv_scale, gen)
            want_cache = got_cache.clone()
            width = layer.qk_nope_head_dim + layer.qk_rope_head_dim if kind == "mla" else layer.head_size
            q = self.query(layer, batch.num_tokens, width, gen)
            topk = sparse_topk(batch, 8, gen) if sparse else None
            checks.poison_allocator(self.device)
            md = batch.metadata
            got = forward_by_role(backend, impl, q, new_kv, got_cache, md, kv_scale, topk)
            want = forward_by_role(TorchRefBackend, ref, q, new_kv, want_cache, md, kv_scale, topk)
            what = f"forward, kv_cache_dtype={kv_dtype}, q_lens={q_lens}"
            checks.assert_output_close(got, want, self.tolerances[self.dtype], what)
            checks.assert_cache_close(got_cache, want_cache, kv_scale, what)

    # ---- CUDA-graph decode (what capabilities.cuda_graph promises) ------------------------------
    def test_graph_style_decode_with_padded_rows(
        self, backend: type[AttentionBackend], kind: str, gen: torch.Generator
    ) -> None:
        """A decode step as a CUDA-graph replay sees it: Python lengths are upper bounds (the
        engine's max_model_len), a padded row has seq_len 0 and slot -1. Real rows must match
        the reference, the padded row must give exactly 0 and write nothing."""
        if backend.capabilities.cuda_graph == "never":
            pytest.skip("the backend does not claim CUDA-graph decode")
        layer = self.layer(kind, self.base_kv_dtype(backend))
        impl, ref = self.impls(backend, layer, gen)
        bs = self.block_size_list(backend)[0]
        batch = make_batch([1, 1, 1], [5, 2 * bs + 3, 9], 3, bs, self.device, gen)
        kv_scale = self.kv_scale(layer.kv_cache_dtype)
        got_cache, (key, value) = self.filled(layer, batch, kv_scale, gen)
        want_cache = got_cache.clone()
        width = layer.qk_nope_head_dim + layer.qk_rope_head_dim if kind == "mla" else layer.head_size
        q = self.query(layer, 4, width, gen)  # the fourth row is padding
        pad_kv = random_kv(layer, 1, self.dtype, self.device, gen)
        md = batch.metadata
        bound = md.block_table.shape[1] * bs
        padded = dataclasses.replace(
            md,
            query_start_loc=torch.arange(5, dtype=torch.int32, device=self.device),
            seq_lens=torch.cat([md.seq_lens, md.seq_lens.new_zeros(1)]),
            block_table=torch.cat([md.block_table, md.block_table[:1]]),
            slot_mapping=torch.cat([md.slot_mapping, md.slot_mapping.new_full((1,), -1)]),
            query_start_loc_cpu=torch.arange(5, dtype=torch.int32),
            seq_lens_cpu=torch.full((4,), bound, dtype=torch.int32),
            max_seq_len=bound,
            num_decodes=4,
            num_decode_tokens=4,
            extra={},
        )
        padded = backend.metadata_builder().build(padded, for_capture=True)
        checks.poison_allocator(self.device)
        got = impl.forward(  # type: ignore[attr-defined]
            q, torch.cat([key, pad_kv[0]]), torch.cat([value, pad_kv[1]]), got_cache, padded, kv_scale=kv_scale
        )
        want = ref.forward(q[:3], key, value, want_cache, md, kv_scale=kv_scale)  # type: ignore[attr-defined]
        what = "graph-style decode (upper-bound lengths, one padded row)"
        checks.assert_output_close(got[:3], want, self.tolerances[self.dtype], what)
        assert torch.equal(got[3], torch.zeros_like(got[3])), f"{what}: the padded row is not exactly 0"
        checks.assert_cache_close(got_cache, want_cache, kv_scale, f"{what}: cache")

    # ---- fail closed -------------------------------------------------------------------------------
    def test_bad_inputs_are_rejected_at_the_entry(
        self, backend: type[AttentionBackend], kind: str, gen: torch.Generator
    ) -> None:
        caps = backend.capabilities
        layer = self.layer(kind, self.base_kv_dtype(backend))
        impl, _ = self.impls(backend, layer, gen)
        bs = self.block_size_list(backend)[0]
        batch = make_batch([1, 2], [3, bs + 2], 1, bs, self.device, gen)
        md, slots = batch.metadata, batch.metadata.slot_mapping
        cache, (key, value) = self.filled(layer, batch, None, gen)
        q = self.query(layer, batch.num_tokens, query_width(layer), gen)
        checks.assert_rejects(lambda: impl.attend(q.double(), cache, md), "attend with a float64 query")
        checks.assert_rejects(lambda: impl.attend(q[:, :-1], cache, md), "attend with too few heads")
        checks.assert_rejects(
            lambda: impl.write_kv(cache, slots, key[:, :-1], value), "write_kv, key too narrow"
        )
        checks.assert_rejects(lambda: impl.write_kv(cache, slots, key.double(), value.double()), "float64 KV")
        too_far = torch.full_like(slots, cache.numel())  # far past num_blocks * block_size
        checks.assert_rejects(
            lambda: impl.write_kv(cache, too_far, key, value), "write_kv, slot out of range"
        )
        wide = cache.new_zeros(*cache.shape[:-1], cache.shape[-1] + 1)
        checks.assert_rejects(
            lambda: impl.write_kv(wide, slots, key, value), "write_kv, cache record too wide"
        )
        if "fp8_e4m3" in caps.kv_cache_dtypes:
            fp8_layer = self.layer(kind, "fp8_e4m3")
            fp8_impl, _ = self.impls(backend, fp8_layer, gen)
            fp8_cache = poisoned_cache(fp8_layer, batch, self.dtype, self.device)
            checks.assert_rejects(
                lambda: fp8_impl.write_kv(fp8_cache, slots, key, value), "fp8 write_kv without scale"
            )
            checks.assert_rejects(lambda: fp8_impl.attend(q, fp8_cache, md), "fp8 attend without scale")


def forward_by_role(
    backend: type[AttentionBackend],
    impl: AttentionImpl,
    q: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scale: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
) -> torch.Tensor:
    """`impl.forward` over a step's batch as a model layer runs it with `backend` in both roles:
    divided where the engine divides it (MLA: by role), each part's metadata built as the
    engine builds it (GroupMetadataBuilder: the backend's own builder per role)."""
    outs = []
    for part in GroupMetadataBuilder(backend, backend, [impl.layer]).build(metadata):
        rows = part.rows
        sparse = {} if topk_indices is None else {"topk_indices": topk_indices[rows]}
        outs.append(impl.forward(  # type: ignore[attr-defined]
            q[rows], new_kv[0][rows], new_kv[1][rows], cache, part.metadata, kv_scale=kv_scale, **sparse
        ))
    return torch.cat(outs)
