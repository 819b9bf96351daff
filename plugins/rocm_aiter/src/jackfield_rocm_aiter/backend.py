"""The rocm_aiter_mla backend: AITER's MLA decode behind jackfield's MLA impl base.

The base (`jackfield.attention.MLAImpl`) owns the weight split, the query absorption, the KV
write and the expanded prefill (plain PyTorch, which runs on ROCm as it is); this impl supplies
`attend`, the absorbed decode, through `aiter.mla.mla_decode_fwd` on AITER's non-persistent path.
Before each call it checks that the installed manifest lists the kernel the call needs, since
AITER aborts the process when none matches.
"""

from __future__ import annotations

import dataclasses

import torch
from jackfield.attention import MLAImpl
from jackfield.attention.checks import check_attend_inputs
from jackfield.attention.kv_cache import FP8_DTYPE
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionOutput,
    AttentionRequirements,
    Availability,
    KVCacheDType,
)

from jackfield_rocm_aiter.capabilities import ROCM_AITER_MLA_CAPABILITIES
from jackfield_rocm_aiter.layout import RocmAiterMetadataBuilder, layout_for
from jackfield_rocm_aiter.manifest import SERVED_NUM_HEADS
from jackfield_rocm_aiter.platform import AiterPlatform, PlatformProbe, probe_platform

KV_LORA_RANK, ROPE_DIM = 512, 64  # the record AITER's MLA kernels read: 576 wide, 512 of it the value


class RocmAiterMLAImpl(MLAImpl):
    def __init__(self, layer: AttentionLayerSpec, platform: AiterPlatform) -> None:
        super().__init__(layer)
        problems = []
        if layer.num_heads not in SERVED_NUM_HEADS:
            problems.append(f"{layer.num_heads} heads (AITER's MLA decode: {SERVED_NUM_HEADS})")
        if (layer.kv_lora_rank, layer.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
            problems.append(f"kv_lora_rank {layer.kv_lora_rank} + rope {layer.qk_rope_head_dim} "
                            f"(AITER's MLA kernels: {KV_LORA_RANK} + {ROPE_DIM})")
        if layer.sliding_window is not None:
            problems.append(f"sliding window {layer.sliding_window} (not supported)")
        if problems:
            raise ValueError("rocm_aiter_mla cannot serve this layer: " + "; ".join(problems))
        self.platform = platform

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
        lay = self.layer
        if sinks is not None or topk_indices is not None:
            raise ValueError("rocm_aiter_mla supports neither attention sinks nor sparse top-k attention")
        check_attend_inputs(lay, query, kv_cache, metadata, kv_scale, sinks, topk_indices)
        if query.dtype != torch.bfloat16:
            raise ValueError(f"AITER's MLA decode reads bfloat16 queries, got {query.dtype}")
        if kv_cache.dtype not in (torch.bfloat16, FP8_DTYPE):
            raise ValueError(f"AITER's MLA decode reads bfloat16 or fp8_e4m3 caches, got {kv_cache.dtype}")
        if metadata.num_decodes != metadata.num_reqs:
            raise ValueError(
                f"rocm_aiter_mla attends decode rows only, got {metadata.num_reqs - metadata.num_decodes} "
                "prefill requests (prefill rows take the expanded form, MLAImpl.prefill)"
            )
        num_rows, heads = query.shape[0], lay.num_heads
        if num_rows == 0:
            lse = query.new_empty(0, heads, dtype=torch.float32) if return_lse else None
            return AttentionOutput(query.new_empty(0, heads, lay.kv_lora_rank), lse)
        query_len = metadata.max_query_len
        if query_len > ROCM_AITER_MLA_CAPABILITIES.max_decode_query_len:
            raise ValueError(f"decode query length {query_len} exceeds AITER's "
                             f"{ROCM_AITER_MLA_CAPABILITIES.max_decode_query_len}")
        kv_cache_dtype: KVCacheDType = "fp8_e4m3" if kv_cache.dtype == FP8_DTYPE else "bfloat16"
        refusals = self.platform.decode_refusals(kv_cache_dtype, query_len, metadata.causal, (heads,))
        if refusals:  # never call AITER without its kernel: it would abort the process
            raise ValueError("AITER cannot run this decode batch: " + "; ".join(refusals))

        layout = layout_for(metadata)
        num_padded = metadata.num_reqs * query_len
        q = query
        if layout.padded_rows is not None:
            q = query.new_zeros(num_padded, heads, query.shape[2]).index_copy_(0, layout.padded_rows, query)
        q_scale = None
        if kv_cache.dtype == FP8_DTYPE:  # fp8 over fp8: AITER's non-persistent decode has no bf16-over-fp8
            q, q_scale = fp8_query(q, self.platform.fp8_dtype)
        out = torch.empty(num_padded, heads, lay.kv_lora_rank, dtype=torch.bfloat16, device=query.device)
        # Only what differs from the defaults, so releases that lack a parameter still take the
        # call: page_size and nhead_kv stay 1 (older releases read them from the view's shape);
        # `causal` only when it matters (with one row a request the mask is a no-op, and an AITER
        # without the parameter is causal only).
        options: dict[str, bool] = {}
        if return_lse:
            options["return_lse"] = True
        if not metadata.causal and query_len > 1:
            options["causal"] = False
        _, lse = self.platform.mla_decode_fwd(
            q,
            kv_cache.view(-1, 1, 1, kv_cache.shape[-1]),  # pages of one token, one latent "head"
            out,  # AITER writes the merged output here (what it returns may be its split partials)
            layout.qo_indptr,
            layout.kv_indptr,
            layout.kv_indices(kv_cache.shape[1]),
            layout.kv_last_page_lens,
            query_len,
            sm_scale=lay.scale,
            q_scale=q_scale,
            kv_scale=None if kv_scale is None else kv_scale.reshape(1),
            **options,
        )
        lse = lse if return_lse else None  # without return_lse some paths hand back split LSEs
        if layout.padded_rows is not None:
            out = out[layout.padded_rows]
            lse = None if lse is None else lse[layout.padded_rows]
        return AttentionOutput(out, lse)


def fp8_query(q: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q in `fp8_dtype` and its per-tensor float32 scale [1] (q ~ q_fp8 * scale): the largest |q|
    maps to the format's largest finite value. Computed on the device, no sync."""
    fp8_max = torch.finfo(fp8_dtype).max
    scale = (q.abs().amax().float() / fp8_max).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
    return (q.float() / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype), scale


class RocmAiterMLABackend(AttentionBackend):
    name = "rocm_aiter_mla"
    capabilities = ROCM_AITER_MLA_CAPABILITIES

    @classmethod
    def platform_probe(cls) -> PlatformProbe:
        """The AITER installation this backend calls (the emulator's, in this plugin's tests)."""
        return probe_platform()

    @classmethod
    def availability(cls) -> Availability:
        return cls.platform_probe().availability()

    @classmethod
    def supports_non_causal(
        cls, device: torch.device | str, kv_cache_dtype: KVCacheDType = "auto", query_len: int = 1
    ) -> bool:
        """The installed mla_decode_fwd takes `causal`, and the manifest lists the non-causal kernel
        for this cache and query length at every head count the backend serves."""
        platform = cls.platform_probe().platform
        return (platform is not None and torch.device(device).type in cls.capabilities.devices
                and not platform.decode_refusals(kv_cache_dtype, query_len, causal=False))

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        """The record's and the probe's reasons, then one per kernel this machine lacks for the
        decode batches `req` allows (causal, and non-causal where it asks), at every served head
        count: the requirements do not know the model's heads (make_impl checks them)."""
        reasons = super().validate(dataclasses.replace(req, non_causal=False))  # non-causal: below
        platform = cls.platform_probe().platform
        if platform is None:
            return reasons
        masks = (True, False) if req.non_causal else (True,)
        refusals = [reason for query_len in range(1, req.max_decode_query_len + 1) for causal in masks
                    for reason in platform.decode_refusals(req.kv_cache_dtype, query_len, causal)]
        return reasons + list(dict.fromkeys(refusals))  # each reason once

    @classmethod
    def metadata_builder(cls) -> RocmAiterMetadataBuilder:
        return RocmAiterMetadataBuilder()

    @classmethod
    def make_impl(cls, layer: AttentionLayerSpec) -> AttentionImpl:
        if layer.kv_lora_rank <= 0:
            raise ValueError(f"rocm_aiter_mla serves MLA layers only; kv_lora_rank={layer.kv_lora_rank}")
        probe = cls.platform_probe()
        if probe.platform is None:
            raise RuntimeError(f"rocm_aiter_mla is unavailable: {probe.reason}")
        return RocmAiterMLAImpl(layer, probe.platform)
