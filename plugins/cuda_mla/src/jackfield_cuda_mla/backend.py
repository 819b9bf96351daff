"""The cuda_mla backend: Triton kernels behind jackfield's MLA impl base.

The base (`jackfield.attention.MLAImpl`) owns the weight split, query absorption and both forms
(its `decode` hook around `attend`, its expanded `prefill`); this impl supplies the absorbed
kernel (`attend`) and `write_kv`.
"""

from __future__ import annotations

import torch
from jackfield.attention import MLAImpl
from jackfield.attention.checks import check_attend_inputs, check_cache, check_kv_scale
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionOutput,
    AttentionRequirements,
    Availability,
)

from jackfield_cuda_mla.capabilities import CUDA_MLA_CAPABILITIES, cuda_mla_availability
from jackfield_cuda_mla.kernels import mla_decode, mla_kv_insert


class CudaMLAImpl(MLAImpl):
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
        if sinks is not None:
            raise ValueError("cuda_mla does not support attention sinks (capabilities: sinks=False)")
        check_attend_inputs(self.layer, query, kv_cache, metadata, kv_scale, sinks, topk_indices)
        out, lse = mla_decode(
            query,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            sm_scale=self.layer.scale,
            kv_lora_rank=self.layer.kv_lora_rank,
            causal=metadata.causal,
            kv_scale=kv_scale,
            topk_indices=topk_indices,
        )
        return AttentionOutput(out, lse if return_lse else None)

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        check_cache(self.layer, kv_cache)
        check_kv_scale(kv_cache, kv_scale)
        mla_kv_insert(key, value, kv_cache, slot_mapping, kv_scale)


class CudaMLABackend(AttentionBackend):
    name = "cuda_mla"
    capabilities = CUDA_MLA_CAPABILITIES

    @classmethod
    def availability(cls) -> Availability:
        return cuda_mla_availability()

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        """The record's reasons, and the one combination it cannot express: the kernels read a
        16-bit cache in the query's own format, so float16 activations take "auto" or fp8."""
        reasons = super().validate(req)
        if req.kv_cache_dtype == "bfloat16" and req.dtype == torch.float16:
            reasons.append('kv_cache_dtype "bfloat16" with float16 activations (the kernels read a 16-bit '
                           'cache in the query\'s format): use "auto" or "fp8_e4m3", or bfloat16 activations')
        return reasons

    @classmethod
    def make_impl(cls, layer: AttentionLayerSpec) -> AttentionImpl:
        if layer.kv_lora_rank <= 0:
            raise ValueError(f"cuda_mla serves MLA layers only; layer has kv_lora_rank={layer.kv_lora_rank}")
        return CudaMLAImpl(layer)
