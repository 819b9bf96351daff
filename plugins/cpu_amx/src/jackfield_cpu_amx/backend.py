"""The cpu_amx backend: MLA on x86 CPUs, bfloat16 products on AMX tiles, float32 on AVX-512 otherwise."""

from __future__ import annotations

import torch
from jackfield.attention.checks import check_attend_inputs
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
    FUSED_MAX_ROWS,
    attend_group_bmm,
    attend_group_fused,
    gather_group_cache,
)
from jackfield_cpu_amx.plan import (
    PLANS_KEY,
    CpuAmxMetadataBuilder,
    RequestGroup,
    Scratch,
    StepPlan,
    plan_key,
)

COMPUTE_DTYPES: dict[ComputePath, torch.dtype] = {"amx_bf16": torch.bfloat16, "avx512_fp32": torch.float32}
CACHE_DTYPES = (torch.bfloat16, torch.float32)


class CpuAmxMLAImpl(MLAImpl):
    def __init__(self, layer: AttentionLayerSpec, path: ComputePath | None = None) -> None:
        super().__init__(layer)
        self.path: ComputePath = detected_amx_status().path if path is None else path
        self.compute_dtype = COMPUTE_DTYPES[self.path]
        self.w_uk_bmm: torch.Tensor | None = None  # [H, N, L] compute dtype: q_nope -> latent, one bmm
        self.w_uv_bmm: torch.Tensor | None = None  # [H, L, V] compute dtype: latent out -> v, one bmm

    def process_weights_after_loading(self, weights: dict[str, torch.Tensor]) -> None:
        super().process_weights_after_loading(weights)
        w_uk, w_uv = self._weights()
        self.w_uk_bmm = w_uk.to(self.compute_dtype).contiguous()
        self.w_uv_bmm = w_uv.to(self.compute_dtype).contiguous()

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """[t, H, N+R] -> [t, H, L+R]: one head-batched product in the compute dtype."""
        if self.w_uk_bmm is None:
            self._weights()  # raises the not-loaded error
        assert self.w_uk_bmm is not None
        n = self.layer.qk_nope_head_dim
        q_nope = q[..., :n].to(self.compute_dtype).transpose(0, 1)  # [H, t, N]
        q_lat = torch.bmm(q_nope, self.w_uk_bmm).transpose(0, 1)  # [t, H, L]
        return torch.cat([q_lat.to(q.dtype), q[..., n:]], dim=-1)

    def _absorbed(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scale: torch.Tensor | None,
        topk_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        # Overrides MLAImpl's float32 einsum with W_UV applied as one head-batched product.
        o_lat = self.attend(
            self.absorb_query(q), kv_cache, metadata, kv_scale=kv_scale, topk_indices=topk_indices
        ).out
        assert self.w_uv_bmm is not None
        o = torch.bmm(o_lat.to(self.compute_dtype).transpose(0, 1), self.w_uv_bmm)  # [H, t, V]
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
        plan, scratch = _checked_plan(query, kv_cache, metadata, kv_scale, sinks, topk_indices)
        lay = self.layer
        # NaN-filled (cheap next to the cache read) so a row no group wrote cannot pass as a result.
        out = query.new_full((query.shape[0], lay.num_heads, lay.kv_lora_rank), float("nan"))
        lse = torch.full(query.shape[:2], float("nan"), dtype=torch.float32)
        for group in plan.groups:
            t0, t1 = group.token_start, group.token_start + group.num_reqs * group.q_len
            fused = _uses_fused(group, lay.num_heads)
            chunks = group.key_chunks(kv_cache.shape[1], split=fused)
            keys = gather_group_cache(kv_cache, group, chunks, self.compute_dtype, scratch)
            attend = attend_group_fused if fused else attend_group_bmm
            attend(query[t0:t1], keys, group, chunks, lay.kv_lora_rank, lay.scale, out[t0:t1], lse[t0:t1])
        return AttentionOutput(out, lse if return_lse else None)


def _uses_fused(group: RequestGroup, num_heads: int) -> bool:
    return group.q_len * num_heads <= FUSED_MAX_ROWS


def _checked_plan(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scale: torch.Tensor | None,
    sinks: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
) -> tuple[StepPlan, Scratch]:
    """What cpu_amx needs beyond the common checks: its own plan, a CPU cache it can read."""
    unsupported = [
        name for name, arg in (("sinks", sinks), ("topk_indices", topk_indices)) if arg is not None
    ]
    if unsupported:
        raise ValueError(f"cpu_amx does not support {', '.join(unsupported)}")
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
    num_blocks = kv_cache.shape[0]
    for group in plan.groups:
        ids = group.key_chunks(kv_cache.shape[1], split=_uses_fused(group, query.shape[1])).block_ids
        if ids.numel() and (int(ids.max()) >= num_blocks or int(ids.min()) < 0):
            raise ValueError(
                f"block_table holds block {int(ids.max())} / {int(ids.min())}, the cache has {num_blocks}"
            )
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
        if layer.kv_lora_rank <= 0:
            raise ValueError("cpu_amx serves MLA layers only (kv_lora_rank > 0)")
        return CpuAmxMLAImpl(layer)
