"""The conformance harness: class attributes a backend author sets, the backend fixture, the case
record the tests are generated over, and the problem builders the tests share.

The tests themselves live in `conformance.py` (`AttentionConformance` subclasses this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionKind,
    AttentionLayerSpec,
    AttentionOutput,
    KVCacheDType,
)
from jackfield.testing import checks
from jackfield.testing.problems import (
    PagedBatch,
    make_batch,
    mha_layer,
    mla_layer,
    poisoned_cache,
    query_width,
    random_kv,
    sparse_topk,
)
from jackfield.testing.pytest_plugin import GPU_SKIP_REASON


@dataclass(frozen=True)
class Case:
    """One generated combination a test runs: a declared kind, activation dtype and kv-cache dtype,
    and the test's variant (a mask or a claimed feature, e.g. "non_causal", "sinks")."""

    kind: AttentionKind
    dtype: torch.dtype
    kv_cache_dtype: KVCacheDType
    variant: str = ""

    @property
    def id(self) -> str:
        parts = (self.kind, str(self.dtype).removeprefix("torch."), f"kv_{self.kv_cache_dtype}", self.variant)
        return "-".join(part for part in parts if part)


class ConformanceHarness:
    backend_name: ClassVar[str | None] = None
    backend_cls: ClassVar[type[AttentionBackend] | None] = None
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None  # None: every declared activation dtype
    num_heads: ClassVar[int] = 4
    kv_lora_rank: ClassVar[int] = 64
    qk_rope_head_dim: ClassVar[int] = 16
    qk_nope_head_dim: ClassVar[int] = 32
    v_head_dim: ClassVar[int] = 32
    mha_num_kv_heads: ClassVar[int] = 2
    mha_head_size: ClassVar[int] = 32
    block_sizes: ClassVar[tuple[int, ...] | None] = None  # None: derived from the capabilities
    # fp8 per-tensor scales (MLA: the first; MHA: key, value): |x| up to ~9 stays unclamped; the
    # key and value scales differ, so a backend that swaps them or uses one for both fails
    kv_scale_values: ClassVar[tuple[float, float]] = (0.02, 0.03)
    tolerances: ClassVar[dict[torch.dtype, float]] = {
        torch.float32: 1e-4,
        torch.bfloat16: 2e-2,
        torch.float16: 1e-2,
    }

    # ---- what is declared (collection time) and what this machine runs (the fixture) ---------
    @classmethod
    def declared_backend(cls) -> type[AttentionBackend]:
        return checks.resolve_backend(cls.backend_name, cls.backend_cls)

    @classmethod
    def declared_dtypes(cls, backend: type[AttentionBackend]) -> tuple[torch.dtype, ...]:
        declared = backend.capabilities.activation_dtypes
        if cls.dtypes is None:
            return declared
        undeclared = [d for d in cls.dtypes if d not in declared]
        if undeclared:
            pytest.fail(f"dtypes {undeclared} are not among {backend.name}'s activation dtypes {declared}")
        return cls.dtypes

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> type[AttentionBackend]:
        backend = cls.declared_backend()
        if torch.device(cls.device).type == "cuda" and not torch.cuda.is_available():
            pytest.skip(GPU_SKIP_REASON)
        available = backend.availability()
        if not available.ok:
            pytest.skip(f"{backend.name} unavailable here: {available.reason}")
        return backend

    @pytest.fixture
    def gen(self, rng_seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(rng_seed)

    # ---- problem builders ----------------------------------------------------------------------
    def base_kv_dtype(self, backend: type[AttentionBackend]) -> KVCacheDType:
        dtypes = backend.capabilities.kv_cache_dtypes
        return "auto" if "auto" in dtypes else dtypes[0]

    def layer(
        self, kind: str, kv_cache_dtype: KVCacheDType = "auto", sliding_window: int | None = None
    ) -> AttentionLayerSpec:
        if kind == "mla":
            return mla_layer(
                self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim,
                self.v_head_dim, kv_cache_dtype, sliding_window,
            )  # fmt: skip
        return mha_layer(
            self.num_heads, self.mha_num_kv_heads, self.mha_head_size, kv_cache_dtype, sliding_window
        )

    def impls(
        self,
        backend: type[AttentionBackend],
        layer: AttentionLayerSpec,
        dtype: torch.dtype,
        g: torch.Generator,
    ) -> tuple[AttentionImpl, AttentionImpl]:
        """(backend impl, torch_ref impl) for `layer`, MLA weights loaded identically."""
        caps = backend.capabilities
        if caps.head_sizes is not None and layer.head_size not in caps.head_sizes:
            pytest.fail(
                f"head size {layer.head_size} not in {caps.head_sizes}: set the shape class attributes"
            )
        impl, ref = backend.make_impl(layer), TorchRefBackend.make_impl(layer)
        if layer.kv_lora_rank:
            n_out = layer.num_heads * (layer.qk_nope_head_dim + layer.v_head_dim)
            w = torch.randn(n_out, layer.kv_lora_rank, generator=g) * layer.kv_lora_rank**-0.5
            for target in (impl, ref):
                target.process_weights_after_loading({"kv_b_proj": w.to(device=self.device, dtype=dtype)})
        return impl, ref

    def tolerance(self, dtype: torch.dtype, kv_cache_dtype: KVCacheDType) -> float:
        """The error allowed, relative to the output's scale (absolute for the LSE): `tolerances`
        by activation dtype. A backend whose kernels round more than that dtype does for some
        cache (one that quantizes the query to fp8 over an fp8 cache) overrides this for it."""
        return self.tolerances[dtype]

    def kv_scale(self, layer: AttentionLayerSpec) -> torch.Tensor | None:
        """The layer's fp8 scales ([1] for MLA, [2] key and value for MHA); None for other caches."""
        if layer.kv_cache_dtype != "fp8_e4m3":
            return None
        values = self.kv_scale_values[:1] if layer.kv_lora_rank else self.kv_scale_values
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def filled(
        self,
        layer: AttentionLayerSpec,
        batch: PagedBatch,
        dtype: torch.dtype,
        kv_scale: torch.Tensor | None,
        g: torch.Generator,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A poisoned cache holding the context KV (written by torch_ref), and this step's new KV."""
        cache = poisoned_cache(layer, batch, dtype, self.device)
        context_kv = random_kv(layer, batch.context_slots.numel(), dtype, self.device, g)
        TorchRefBackend.make_impl(layer).write_kv(cache, batch.context_slots, *context_kv, kv_scale)
        return cache, random_kv(layer, batch.num_tokens, dtype, self.device, g)

    def query(
        self, layer: AttentionLayerSpec, rows: int, width: int, dtype: torch.dtype, g: torch.Generator
    ) -> torch.Tensor:
        return torch.randn(rows, layer.num_heads, width, generator=g).to(device=self.device, dtype=dtype)

    def check_attend(
        self,
        backend: type[AttentionBackend],
        layer: AttentionLayerSpec,
        batch: PagedBatch,
        dtype: torch.dtype,
        g: torch.Generator,
        *,
        what: str,
        sinks: torch.Tensor | None = None,
        topk: int | None = None,
    ) -> None:
        """attend on one cache (this step's KV already in it) vs torch_ref, output and LSE."""
        impl, ref = self.impls(backend, layer, dtype, g)
        kv_scale = self.kv_scale(layer)
        cache, new_kv = self.filled(layer, batch, dtype, kv_scale, g)
        ref.write_kv(cache, batch.metadata.slot_mapping, *new_kv, kv_scale)
        q = self.query(layer, batch.num_tokens, query_width(layer), dtype, g)
        topk_indices = None if topk is None else sparse_topk(batch, topk, g)
        kwargs = dict(
            kv_scale=kv_scale, sinks=sinks, topk_indices=topk_indices, return_lse=backend.capabilities.dcp
        )
        before = cache.clone()
        checks.poison_allocator(self.device)
        got: AttentionOutput = impl.attend(q, cache, batch.metadata, **kwargs)
        checks.same_bytes(cache, before, f"{what}: attend modified the KV cache")
        want: AttentionOutput = ref.attend(q, cache, batch.metadata, **kwargs)
        tol = self.tolerance(dtype, layer.kv_cache_dtype)
        checks.assert_output_close(got.out, want.out, tol, f"{what}: output")
        if backend.capabilities.dcp:
            checks.assert_lse_close(got.lse, want.lse, tol, f"{what}: lse")

    def block_size_list(self, backend: type[AttentionBackend]) -> list[int]:
        if self.block_sizes is not None:
            return list(self.block_sizes)
        m, preferred = backend.capabilities.block_size_multiple, backend.capabilities.preferred_block_size
        return sorted({m, max(2 * m, 16)} | ({preferred} if preferred else set()))

    def batches(
        self, backend: type[AttentionBackend], kind: str, g: torch.Generator, *, causal: bool = True
    ) -> list[tuple[str, PagedBatch]]:
        """Decode, multi-token decode and (for MHA, whose attend serves every row) prefill batches."""
        max_q = min(backend.capabilities.max_decode_query_len, 4)
        out: list[tuple[str, PagedBatch]] = []
        for bs in self.block_size_list(backend):

            def rand(lo: int, hi: int) -> int:
                return int(torch.randint(lo, hi + 1, (), generator=g))

            seqs = [1, *(rand(2, 3 * bs + 3) for _ in range(3))]
            plans = {"decode": ([1] * 4, seqs, 4)}
            if max_q > 1:
                q_lens = [max_q, *(rand(1, max_q) for _ in range(3))]
                plans["multi-token decode"] = (
                    q_lens,
                    [max(q, s) for q, s in zip(q_lens, seqs, strict=True)],
                    4,
                )
            if kind == "mha":
                q_lens = [1, 1, rand(2, 12), rand(2, 12)]
                plans["decode+chunked prefill"] = (q_lens, [q + rand(0, 2 * bs) for q in q_lens], 2)
            for name, (q_lens, seq_lens, nd) in plans.items():
                batch = make_batch(q_lens, seq_lens, nd, bs, self.device, g, causal=causal)
                out.append((f"{name}, block_size={bs}, q_lens={q_lens}, seq_lens={seq_lens}", batch))
        return out
