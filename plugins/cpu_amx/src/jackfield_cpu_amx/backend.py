"""The cpu_amx backend: MLA and standard attention (MHA/GQA/MQA) on x86 CPUs, bfloat16 products on
AMX tiles, float32 on AVX-512 otherwise.

MLA: decode groups go to the native AMX kernel (native.py) when it is built and the group fits
it, everything else to the PyTorch kernels (kernels.py): gather the group's cache, then the flash
kernel (or, for many float32 rows, two batched products).
MHA: every group gathers its keys and values with one index op, then runs one call of the flash
kernel with the KV heads shared in it (GQA), masks from the step's plan. A group of one query
token a request (decode) gathers record by record only the keys its requests see (plan.DecodeRows);
a step of decodes alone returns the kernel's output itself.
"""

from __future__ import annotations

import torch
from jackfield.attention.checks import check_attend_inputs
from jackfield.attention.kv_cache import is_mla
from jackfield.attention.mha import MHAImpl
from jackfield.attention.mla import MLAImpl
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionOutput,
    Availability,
)

from jackfield_cpu_amx.capabilities import (
    CPU_AMX_CAPABILITIES,
    ComputePath,
    availability,
    detected_amx_status,
)
from jackfield_cpu_amx.kernels import (
    add_sinks,
    attend_decode_mha,
    attend_group_bmm,
    attend_group_fused,
    attend_group_mha,
    gather_decode_kv,
    gather_group_cache,
    gather_group_kv,
)
from jackfield_cpu_amx.native import NativeKernel, native_decode_kernel, unfit_reason
from jackfield_cpu_amx.plan import (
    NATIVE_MAX_Q_LEN,
    PLANS_KEY,
    CpuAmxMetadataBuilder,
    RequestGroup,
    Scratch,
    StepPlan,
    plan_key,
)

CACHE_DTYPES = (torch.bfloat16, torch.float32)


def compute_dtype(path: ComputePath, activation_dtype: torch.dtype) -> torch.dtype:
    """The products' input dtype: bfloat16 only on the AMX path for bfloat16 activations. A float32
    request is computed in float32 on every path (AMX has no float32 products: oneDNN runs them on
    AVX-512), so asking for float32 never silently yields bfloat16 precision."""
    return torch.bfloat16 if path == "amx_bf16" and activation_dtype == torch.bfloat16 else torch.float32


class CpuAmxMLAImpl(MLAImpl):
    def __init__(
        self,
        layer: AttentionLayerSpec,
        path: ComputePath | None = None,
        native_kernel: NativeKernel | str | None = None,
    ) -> None:
        """`path` and `native_kernel` default to what this process detected; a string for
        `native_kernel` keeps every group on the PyTorch kernels and says why."""
        super().__init__(layer)
        self.path: ComputePath = detected_amx_status().path if path is None else path
        self.native_kernel = native_decode_kernel() if native_kernel is None else native_kernel
        # W_UK [H, N, L] and W_UV [H, L, V] per compute dtype: float32 (the base's), and bfloat16
        # copies on the AMX path, so each absorption is one head-batched product in that dtype.
        self.bmm_weights: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def process_weights_after_loading(self, weights: dict[str, torch.Tensor]) -> None:
        super().process_weights_after_loading(weights)
        w_uk, w_uv = self._weights()
        self.bmm_weights = {torch.float32: (w_uk, w_uv)}
        if self.path == "amx_bf16":
            self.bmm_weights[torch.bfloat16] = (
                w_uk.to(torch.bfloat16).contiguous(),
                w_uv.to(torch.bfloat16).contiguous(),
            )

    def _bmm_weights(self, activation_dtype: torch.dtype) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
        self._weights()  # raises the not-loaded error
        dtype = compute_dtype(self.path, activation_dtype)
        return (dtype, *self.bmm_weights[dtype])

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """[t, H, N+R] -> [t, H, L+R]: one head-batched product in the compute dtype."""
        dtype, w_uk, _ = self._bmm_weights(q.dtype)
        n = self.layer.qk_nope_head_dim
        q_nope = q[..., :n].to(dtype).transpose(0, 1)  # [H, t, N]
        q_lat = torch.bmm(q_nope, w_uk).transpose(0, 1)  # [t, H, L]
        return torch.cat([q_lat.to(q.dtype), q[..., n:]], dim=-1)

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MLAImpl's absorbed decode with W_UV applied as one head-batched product in the compute
        dtype (the base applies it in float32)."""
        dtype, _, w_uv = self._bmm_weights(q.dtype)
        o_lat = self.attend(
            self.absorb_query(q), kv_cache, metadata, kv_scale=kv_scale, topk_indices=topk_indices
        ).out
        o = torch.bmm(o_lat.to(dtype).transpose(0, 1), w_uv)  # [H, t, V]
        return o.transpose(0, 1).to(q.dtype)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> AttentionOutput:
        check_attend_inputs(self.layer, query, kv_cache, metadata, kv_scale, sinks, topk_indices)
        _refuse_topk(topk_indices)
        lay = self.layer
        dtype = compute_dtype(self.path, query.dtype)
        plan, scratch = _checked_plan(query, kv_cache, metadata, kv_scale)
        q = query.to(dtype)
        # Every row is written below: the plan's groups tile the query rows (StepPlan checks).
        out = query.new_empty((query.shape[0], lay.num_heads, lay.kv_lora_rank))
        lse = torch.empty(query.shape[:2], dtype=torch.float32)
        for group in plan.groups:
            t0, t1 = group.token_start, group.token_start + group.num_reqs * group.q_len
            if self.native_unfit_reason(group, q, kv_cache) is None:
                self._decode_native(group, q[t0:t1], kv_cache, out[t0:t1], lse[t0:t1])
                continue
            fused = plan.fused(group, lay.num_heads, dtype)
            chunks = group.key_chunks(kv_cache.shape[1], split=fused, sliding_window=lay.sliding_window)
            _check_block_span(chunks.block_span, kv_cache.shape[0])
            keys = gather_group_cache(kv_cache, group, chunks, dtype, scratch)
            attend = attend_group_fused if fused else attend_group_bmm
            attend(q[t0:t1], keys, group, chunks, lay.kv_lora_rank, lay.scale, out[t0:t1], lse[t0:t1])
        if sinks is not None:
            add_sinks(out, lse, sinks)
        return AttentionOutput(out, lse if return_lse else None)

    def _decode_native(
        self,
        group: RequestGroup,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        assert isinstance(self.native_kernel, NativeKernel) and group.decode_tables is not None
        layout = group.native_layout(kv_cache.shape[1], self.layer.num_heads, torch.get_num_threads())
        self.native_kernel.decode(  # checks the layout's block ids against this cache
            query.contiguous(), kv_cache, group.decode_tables, layout, self.layer.scale, out, lse
        )

    def native_unfit_reason(
        self, group: RequestGroup, query: torch.Tensor, kv_cache: torch.Tensor
    ) -> str | None:
        """Why this group does not go to the native kernel (None: it does); `query` in the
        compute dtype."""
        if not isinstance(self.native_kernel, NativeKernel):
            return self.native_kernel
        if self.path != "amx_bf16":
            return f"the {self.path} path was asked for"
        if self.layer.sliding_window is not None:
            return "the native kernel has no sliding window"
        return unfit_reason(query, kv_cache, self.layer.kv_lora_rank, group.q_len)


class CpuAmxMHAImpl(MHAImpl):
    """Standard attention with grouped KV heads (MHA, GQA, MQA), sliding windows and sinks."""

    def __init__(self, layer: AttentionLayerSpec, path: ComputePath | None = None) -> None:
        super().__init__(layer)
        self.path: ComputePath = detected_amx_status().path if path is None else path

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> AttentionOutput:
        check_attend_inputs(self.layer, query, kv_cache, metadata, kv_scale, sinks, topk_indices)
        _refuse_topk(topk_indices)
        dtype = compute_dtype(self.path, query.dtype)
        plan, scratch = _checked_plan(query, kv_cache, metadata, kv_scale)
        q = query.to(dtype)
        with_lse = return_lse or sinks is not None
        if len(plan.groups) == 1 and plan.groups[0].q_len == 1:  # decode only: the kernel's outputs
            out, lse = self._decode(plan.groups[0], q, kv_cache, scratch, with_lse)
            out = out.to(query.dtype)
        else:
            out, lse = self._attend_groups(plan, q, kv_cache, scratch, with_lse, query.dtype)
        if sinks is not None:
            assert lse is not None
            add_sinks(out, lse, sinks)
        return AttentionOutput(out, lse if return_lse else None)

    def _decode(self, group: RequestGroup, q: torch.Tensor, kv_cache: torch.Tensor, scratch: Scratch,
                with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A group of one query token a request: only the written records of each request's
        visible keys are gathered (plan.DecodeRows), no block padding to zero or mask."""
        rows = group.decode_rows(kv_cache.shape[2], kv_cache.shape[1], self.layer.sliding_window)
        _check_block_span(rows.block_span, kv_cache.shape[1])
        kv = gather_decode_kv(kv_cache, rows, q.dtype, scratch)
        return attend_decode_mha(q, kv, rows, self.layer.scale, with_lse)

    def _attend_groups(self, plan: StepPlan, q: torch.Tensor, kv_cache: torch.Tensor, scratch: Scratch,
                       with_lse: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group of the plan into one output (and LSE), in `out_dtype`."""
        lay = self.layer
        # Every row is written below: the plan's groups tile the query rows (StepPlan checks).
        out = q.new_empty(q.shape, dtype=out_dtype)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for group in plan.groups:
            t0, t1 = group.token_start, group.token_start + group.num_reqs * group.q_len
            if group.q_len == 1:
                group_out, group_lse = self._decode(group, q[t0:t1], kv_cache, scratch, with_lse)
                out[t0:t1].copy_(group_out)
                if group_lse is not None:
                    lse[t0:t1].copy_(group_lse)
                continue
            # Short queries (speculative verification) have few rows per KV head: split their keys
            # so every core has work, and read each key tile once for the heads that share it.
            # Prefill rows fill the cores themselves; a fresh causal one needs no mask.
            short = group.q_len <= NATIVE_MAX_Q_LEN
            chunks = group.key_chunks(
                kv_cache.shape[2], split=short, sliding_window=lay.sliding_window, kernel_causal=not short
            )
            _check_block_span(chunks.block_span, kv_cache.shape[1])
            kv = gather_group_kv(kv_cache, group, chunks, q.dtype, scratch)
            attend_group_mha(q[t0:t1], kv, group, chunks, lay.scale, short, out[t0:t1], lse[t0:t1])
        return out, lse


def _refuse_topk(topk_indices: torch.Tensor | None) -> None:
    if topk_indices is not None:
        raise ValueError("cpu_amx does not support topk_indices (sparse attention)")


def _check_block_span(span: tuple[int, int], num_blocks: int) -> None:
    """The block ids the gather reads (from the step's layout, built once) against this cache."""
    low, high = span
    if high >= num_blocks or low < 0:
        raise ValueError(f"block_table holds block {high} / {low}, the cache has {num_blocks}")


def _checked_plan(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scale: torch.Tensor | None,
) -> tuple[StepPlan, Scratch]:
    """What cpu_amx needs beyond the common checks: its own plan, a CPU cache it can read."""
    if kv_scale is not None or kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"cpu_amx reads bfloat16 or float32 caches, got {kv_cache.dtype} "
            f"(kv_scale {kv_scale is not None})"
        )
    if kv_cache.device.type != "cpu":
        raise ValueError(f"cpu_amx runs on the CPU; the cache is on {kv_cache.device}")
    plans = metadata.extra.get(PLANS_KEY)
    plan = plans.get(plan_key(metadata)) if isinstance(plans, dict) else None
    if plan is None:
        # A caller that skipped the builder (a direct attend call) gets a plan built for this call
        # alone; the engine builds once per step, so layers never land here.
        metadata = CpuAmxMetadataBuilder().build(metadata)
        plan = metadata.extra[PLANS_KEY][plan_key(metadata)]  # type: ignore[index]
    if plan.num_tokens != query.shape[0]:
        raise ValueError(f"the cpu_amx plan covers {plan.num_tokens} query rows, got {query.shape[0]}")
    scratch = metadata.extra.get("cpu_amx_scratch")
    assert isinstance(scratch, Scratch)
    return plan, scratch


class CpuAmxBackend(AttentionBackend):
    name = "cpu_amx"
    capabilities = CPU_AMX_CAPABILITIES

    @classmethod
    def availability(cls) -> Availability:
        return availability()

    @classmethod
    def metadata_builder(cls) -> CpuAmxMetadataBuilder:
        return CpuAmxMetadataBuilder()

    @classmethod
    def make_impl(cls, layer: AttentionLayerSpec) -> AttentionImpl:
        return CpuAmxMLAImpl(layer) if is_mla(layer) else CpuAmxMHAImpl(layer)
