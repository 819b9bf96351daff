"""`AttentionConformance`: the test class a backend author subclasses to be held to torch_ref.

    from jackfield.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        backend_name = "my_mla"   # looked up in the plugin registry, or set backend_cls
        device = "cuda"

The tests are generated from the backend's capability record (`cases`): every kind, activation
dtype and kv-cache dtype it declares, and each feature it claims (non-causal attention, sliding
windows, sinks, sparse top-k, CUDA-graph decode). Nothing is generated that would have to skip;
only facts of the machine do (no CUDA, the backend unavailable here). What the record does not
claim, `validate()` must reject with a reason naming it. Caches start NaN-poisoned, so reading a
slot the metadata does not own shows up as NaN. Shapes are small enough for CPU; override the
class attributes (e.g. kv_lora_rank = 512, qk_rope_head_dim = 64) to match a kernel, and `dtypes`
to run a subset of the declared activation dtypes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from jackfield.attention.metadata import GroupMetadataBuilder
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionRequirements,
)
from jackfield.testing import checks
from jackfield.testing.harness import Case, ConformanceHarness
from jackfield.testing.problems import make_batch, poisoned_cache, query_width, random_kv, sparse_topk

FEATURES = ("sliding_window", "sinks", "sparse_topk", "non_causal", "dcp")
WINDOWS = (1, 5)


class AttentionConformance(ConformanceHarness):
    # ---- generation ----------------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "case" in metafunc.fixturenames:
            cases = self.cases(self.declared_backend())[metafunc.function.__name__]
            metafunc.parametrize("case", cases, ids=[case.id for case in cases])

    def cases(self, backend: type[AttentionBackend]) -> dict[str, list[Case]]:
        """Each test's cases, from the capability record alone: kv-cache dtypes cross the masks
        and the dense forward; each claimed feature runs on the base kv-cache dtype."""
        caps = backend.capabilities
        masks = ["causal", *(["non_causal"] if caps.non_causal else [])]
        features = [f"sliding_window={w}" for w in WINDOWS] if caps.sliding_window else []
        features += [name for name in ("sinks", "sparse_topk") if getattr(caps, name)]
        out: dict[str, list[Case]] = defaultdict(list)
        for kind in caps.kinds:
            for dtype in self.declared_dtypes(backend):
                for kv_cache_dtype in caps.kv_cache_dtypes:
                    case = Case(kind, dtype, kv_cache_dtype)
                    out["test_validate_accepts_what_capabilities_claim"].append(case)
                    out["test_write_kv_matches_reference"].append(case)
                    out["test_attend_matches_reference"] += [
                        dataclasses.replace(case, variant=m) for m in masks
                    ]
                    out["test_forward_matches_reference"].append(dataclasses.replace(case, variant="dense"))
                base = Case(kind, dtype, self.base_kv_dtype(backend))
                out["test_attend_matches_reference"] += [
                    dataclasses.replace(base, variant=f) for f in features
                ]
                if kind == "mla" and caps.sparse_topk:
                    out["test_forward_matches_reference"].append(
                        dataclasses.replace(base, variant="sparse_topk")
                    )
                if caps.cuda_graph != "never":
                    out["test_forward_matches_reference"].append(
                        dataclasses.replace(base, variant="cuda_graph_decode")
                    )
                out["test_validate_rejects_what_capabilities_do_not_claim"].append(base)
                out["test_bad_inputs_are_rejected_at_the_entry"].append(base)
                out["test_capture_build_leaves_run_time_metadata_intact"].append(base)
        return dict(out)  # every test has a case: kinds and dtypes are never empty

    def requirements(self, backend: type[AttentionBackend], case: Case) -> AttentionRequirements:
        return AttentionRequirements(
            kind=case.kind,
            dtype=case.dtype,
            head_size=self.layer(case.kind).head_size,
            block_size=self.block_size_list(backend)[0],
            device=torch.device(self.device).type,
            kv_cache_dtype=case.kv_cache_dtype,
        )

    # ---- capabilities --------------------------------------------------------------------------
    def test_validate_accepts_what_capabilities_claim(
        self, backend: type[AttentionBackend], case: Case
    ) -> None:
        """The baseline, then every claimed feature and the longest claimed decode at once."""
        caps, base = backend.capabilities, self.requirements(backend, case)
        assert backend.validate(base) == [], f"validate({case.id})"
        claimed = {name: True for name in FEATURES if getattr(caps, name)}
        lengths = range(1, caps.max_decode_query_len + 1)
        if claimed.get("non_causal") and not all(
            backend.supports_non_causal(self.device, case.kv_cache_dtype, q) for q in lengths
        ):
            del claimed["non_causal"]  # a fact of this machine, which validate reports
        everything = dataclasses.replace(base, max_decode_query_len=caps.max_decode_query_len, **claimed)
        assert backend.validate(everything) == [], f"validate({case.id} with {sorted(claimed)})"

    def test_validate_rejects_what_capabilities_do_not_claim(
        self, backend: type[AttentionBackend], case: Case
    ) -> None:
        caps, base = backend.capabilities, self.requirements(backend, case)
        cases: list[tuple[dict[str, object], str]] = [
            ({feature: True}, feature) for feature in FEATURES if not getattr(caps, feature)
        ]
        cases += [
            ({"max_decode_query_len": caps.max_decode_query_len + 1}, "decode query length"),
            ({"dtype": torch.float64}, "dtype"),
            ({"device": "meta"}, "device"),
        ]
        if "fp8_e4m3" not in caps.kv_cache_dtypes:
            cases.append(({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype"))
        other_kind = "mha" if case.kind == "mla" else "mla"
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

    # ---- KV writes -----------------------------------------------------------------------------
    def test_write_kv_matches_reference(
        self, backend: type[AttentionBackend], case: Case, gen: torch.Generator
    ) -> None:
        layer = self.layer(case.kind, case.kv_cache_dtype)
        impl, ref = self.impls(backend, layer, case.dtype, gen)
        bs = self.block_size_list(backend)[0]
        batch = make_batch([1, 3, 7], [5, 3 * bs + 1, 9], 1, bs, self.device, gen)
        slots = batch.metadata.slot_mapping.clone()
        slots[torch.randperm(slots.numel(), generator=gen)[:3].to(slots.device)] = -1  # padding rows
        key, value = random_kv(layer, batch.num_tokens, case.dtype, self.device, gen)
        kv_scale = self.kv_scale(layer)
        got, want = (
            poisoned_cache(layer, batch, case.dtype, self.device),
            poisoned_cache(layer, batch, case.dtype, self.device),
        )
        impl.write_kv(got, slots, key, value, kv_scale)
        ref.write_kv(want, slots, key, value, kv_scale)
        checks.assert_cache_close(got, want, kv_scale, f"write_kv, {case.id}")

    # ---- attend --------------------------------------------------------------------------------
    def test_attend_matches_reference(
        self, backend: type[AttentionBackend], case: Case, gen: torch.Generator
    ) -> None:
        """variant: "causal" / "non_causal" masks, "sliding_window=<w>", "sinks", "sparse_topk".
        Non-causal batches run where `supports_non_causal` says this machine serves them."""
        if case.variant == "non_causal" and not backend.supports_non_causal(
            self.device, case.kv_cache_dtype, 1
        ):
            pytest.skip(f"{backend.name} attends non-causally on another device, not on {self.device}")
        window = int(case.variant.removeprefix("sliding_window=")) if "window" in case.variant else None
        layer = self.layer(case.kind, case.kv_cache_dtype, sliding_window=window)
        if case.variant == "sparse_topk":
            for bs in self.block_size_list(backend):
                q_lens, seq_lens = [1, 1, 3, 6], [2 * bs + 1, 4, 3 + bs, 6]
                batch = make_batch(q_lens, seq_lens, 2, bs, self.device, gen)
                self.check_attend(
                    backend, layer, batch, case.dtype, gen, what=f"{case.id}, block_size={bs}", topk=8
                )
            return
        sinks = (
            torch.randn(layer.num_heads, generator=gen).to(self.device) if case.variant == "sinks" else None
        )
        for what, batch in self.batches(backend, case.kind, gen, causal=case.variant != "non_causal"):
            if not batch.metadata.causal and not backend.supports_non_causal(
                self.device, case.kv_cache_dtype, batch.metadata.max_query_len
            ):
                continue  # a kernel this machine lacks (validate says so); the other batches run
            self.check_attend(backend, layer, batch, case.dtype, gen, what=f"{case.id}, {what}", sinks=sinks)

    # ---- forward (write + attend, the batch divided by role as the engine divides it) -----------
    def test_forward_matches_reference(
        self, backend: type[AttentionBackend], case: Case, gen: torch.Generator
    ) -> None:
        """variant: "dense", "sparse_topk" (MLA), "cuda_graph_decode" (what the claim promises)."""
        if case.variant == "cuda_graph_decode":
            self.check_graph_style_decode(backend, case, gen)
            return
        max_q = min(backend.capabilities.max_decode_query_len, 3)
        layer = self.layer(case.kind, case.kv_cache_dtype)
        impl, ref = self.impls(backend, layer, case.dtype, gen)
        bs = self.block_size_list(backend)[0]
        q_lens = [max_q, 1, 5, 9]  # two decodes, then a fresh prefill and a chunked one
        batch = make_batch(q_lens, [max_q + 2 * bs, 3, 5, 9 + bs + 3], 2, bs, self.device, gen)
        kv_scale = self.kv_scale(layer)
        got_cache, new_kv = self.filled(layer, batch, case.dtype, kv_scale, gen)
        want_cache = got_cache.clone()
        width = layer.qk_nope_head_dim + layer.qk_rope_head_dim if case.kind == "mla" else layer.head_size
        q = self.query(layer, batch.num_tokens, width, case.dtype, gen)
        topk = sparse_topk(batch, 8, gen) if case.variant == "sparse_topk" else None
        checks.poison_allocator(self.device)
        md = batch.metadata
        got = forward_by_role(backend, impl, q, new_kv, got_cache, md, kv_scale, topk)
        want = forward_by_role(TorchRefBackend, ref, q, new_kv, want_cache, md, kv_scale, topk)
        what = f"forward, {case.id}, q_lens={q_lens}"
        checks.assert_output_close(got, want, self.tolerance(case.dtype, case.kv_cache_dtype), what)
        checks.assert_cache_close(got_cache, want_cache, kv_scale, what)

    def check_graph_style_decode(
        self, backend: type[AttentionBackend], case: Case, gen: torch.Generator
    ) -> None:
        """A decode step as a CUDA-graph replay sees it: Python lengths are upper bounds (the
        engine's max_model_len), a padded request has seq_len 0 and slot -1. Real rows must match
        the reference, the padded request's rows must give exactly 0 and write nothing. Decode
        (one row a request) and, where the backend serves it, verify (q rows every request)."""
        layer = self.layer(case.kind, case.kv_cache_dtype)
        impl, ref = self.impls(backend, layer, case.dtype, gen)
        bs = self.block_size_list(backend)[0]
        width = layer.qk_nope_head_dim + layer.qk_rope_head_dim if case.kind == "mla" else layer.head_size
        for q_len in sorted({1, min(backend.capabilities.max_decode_query_len, 3)}):
            batch = make_batch([q_len] * 3, [5 + q_len, 2 * bs + 3, 9], 3, bs, self.device, gen)
            kv_scale = self.kv_scale(layer)
            got_cache, (key, value) = self.filled(layer, batch, case.dtype, kv_scale, gen)
            want_cache = got_cache.clone()
            real = 3 * q_len
            q = self.query(layer, real + q_len, width, case.dtype, gen)  # the last request is padding
            pad_key, pad_value = random_kv(layer, q_len, case.dtype, self.device, gen)
            md = batch.metadata
            padded = backend.metadata_builder().build(graph_style_decode(md, bs, q_len), for_capture=True)
            checks.poison_allocator(self.device)
            keys, values = torch.cat([key, pad_key]), torch.cat([value, pad_value])
            got = impl.forward(q, keys, values, got_cache, padded, kv_scale=kv_scale)  # type: ignore[attr-defined]
            want = ref.forward(q[:real], key, value, want_cache, md, kv_scale=kv_scale)  # type: ignore[attr-defined]
            what = f"graph-style decode ({q_len} rows a request, upper-bound lengths, a padded request), {case.id}"
            checks.assert_output_close(got[:real], want, self.tolerance(case.dtype, case.kv_cache_dtype), what)
            assert torch.equal(got[real:], torch.zeros_like(got[real:])), f"{what}: the padded rows are not exactly 0"
            checks.assert_cache_close(got_cache, want_cache, kv_scale, f"{what}: cache")

    # ---- metadata builds: what a CUDA-graph capture may not touch --------------------------------
    def test_capture_build_leaves_run_time_metadata_intact(
        self, backend: type[AttentionBackend], case: Case, gen: torch.Generator
    ) -> None:
        """The builder contract for every backend: a capture-time build (`for_capture=True`) uses
        buffers of its own. One builder (the decode role's) builds a step's run-time metadata, then
        capture-time metadata of another batch, then the run-time metadata again: the first
        build's tensors (its CPU query offsets among them) and its input are byte for byte what
        they were, the capture build shares no storage with them, and the second run-time build
        equals the first."""
        bs = self.block_size_list(backend)[0]
        max_q = min(backend.capabilities.max_decode_query_len, 3)
        run_common = make_batch([max_q, 1, 1], [max_q + bs, 5, 2 * bs + 1], 3, bs, self.device, gen).metadata
        capture_batch = make_batch([1, 1], [3, bs + 2], 2, bs, self.device, gen)
        capture_common = graph_style_decode(capture_batch.metadata, bs)
        builder = backend.metadata_builder()
        run_tensors = checks.metadata_tensors(builder.build(run_common))
        input_tensors = checks.metadata_tensors(run_common)
        before = {path: t.clone() for path, t in run_tensors.items()}
        inputs_before = {path: t.clone() for path, t in input_tensors.items()}
        captured = checks.metadata_tensors(builder.build(capture_common, for_capture=True))
        checks.assert_tensors_unchanged(run_tensors, before, "run-time metadata after a capture-time build")
        checks.assert_tensors_unchanged(input_tensors, inputs_before, "the run-time build's input")
        shared = checks.shared_storage(captured, run_tensors)
        assert not shared, f"the capture-time build shares storage with the run-time metadata: {shared}"
        again = checks.metadata_tensors(builder.build(run_common))
        assert again.keys() == before.keys(), f"a second run-time build holds {sorted(again)}"
        checks.assert_tensors_unchanged(again, before, "a run-time build after a capture-time build")

    # ---- fail closed ---------------------------------------------------------------------------
    def test_bad_inputs_are_rejected_at_the_entry(
        self, backend: type[AttentionBackend], case: Case, gen: torch.Generator
    ) -> None:
        caps = backend.capabilities
        layer = self.layer(case.kind, case.kv_cache_dtype)
        impl, _ = self.impls(backend, layer, case.dtype, gen)
        bs = self.block_size_list(backend)[0]
        batch = make_batch([1, 2], [3, bs + 2], 1, bs, self.device, gen)
        md, slots = batch.metadata, batch.metadata.slot_mapping
        cache, (key, value) = self.filled(layer, batch, case.dtype, None, gen)
        q = self.query(layer, batch.num_tokens, query_width(layer), case.dtype, gen)
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
            fp8_layer = self.layer(case.kind, "fp8_e4m3")
            fp8_impl, _ = self.impls(backend, fp8_layer, case.dtype, gen)
            fp8_cache = poisoned_cache(fp8_layer, batch, case.dtype, self.device)
            checks.assert_rejects(
                lambda: fp8_impl.write_kv(fp8_cache, slots, key, value), "fp8 write_kv without scale"
            )
            checks.assert_rejects(lambda: fp8_impl.attend(q, fp8_cache, md), "fp8 attend without scale")


def graph_style_decode(metadata: AttentionMetadata, block_size: int, query_len: int = 1) -> AttentionMetadata:
    """A decode batch (`query_len` query rows every request) as a CUDA-graph capture sees it: one
    padded request more (seq_len 0, slots -1) and Python lengths that only bound the real ones
    (the whole block table), as the engine records its decode and verify graphs."""
    md, n = metadata, metadata.num_reqs + 1
    bound = md.block_table.shape[1] * block_size
    return dataclasses.replace(
        md,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=md.query_start_loc.device) * query_len,
        seq_lens=torch.cat([md.seq_lens, md.seq_lens.new_zeros(1)]),
        block_table=torch.cat([md.block_table, md.block_table[:1]]),
        slot_mapping=torch.cat([md.slot_mapping, md.slot_mapping.new_full((query_len,), -1)]),
        query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32) * query_len,
        seq_lens_cpu=torch.full((n,), bound, dtype=torch.int32),
        max_query_len=query_len,
        max_seq_len=bound,
        num_decodes=n,
        num_decode_tokens=n * query_len,
        extra={},
    )


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
