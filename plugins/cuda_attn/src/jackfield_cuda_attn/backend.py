"""The cuda_attn backend: Triton kernels behind jackfield's MHA impl base.

One impl serves every row of a step: leading requests of at most 8 query rows (decodes,
multi-token decodes) take the split-KV decode kernel, the rest the prefill kernel. A step whose
longest query has at most 8 rows (every CUDA-graph decode step) takes the decode kernel alone and
reads nothing of the metadata's host side but its shapes and upper bounds.
"""

from __future__ import annotations

import torch
from jackfield.attention import MHAImpl
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

from jackfield_cuda_attn.capabilities import CUDA_ATTN_CAPABILITIES, cuda_attn_availability
from jackfield_cuda_attn.kernels import MAX_DECODE_QUERY_LEN, mha_kv_insert, paged_attention


def decode_part(metadata: AttentionMetadata) -> tuple[int, int, int]:
    """(requests, rows, longest query) the decode kernel serves: all of a step whose queries are
    short (no host values read but the upper bound max_query_len), else its leading decodes."""
    if metadata.max_query_len <= MAX_DECODE_QUERY_LEN:
        return metadata.num_reqs, int(metadata.query_start_loc_cpu[-1]), metadata.max_query_len
    decodes = metadata.num_decodes
    if decodes == 0:
        return 0, 0, 0
    starts = metadata.query_start_loc_cpu[: decodes + 1]
    longest = int(starts.diff().max())
    if longest > MAX_DECODE_QUERY_LEN:  # not decodes this kernel takes: the prefill kernel serves all
        return 0, 0, 0
    return decodes, int(starts[-1]), longest


class CudaAttnImpl(MHAImpl):
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
        if topk_indices is not None:
            raise ValueError(
                "cuda_attn does not support sparse top-k attention (capabilities: sparse_topk=False)"
            )
        check_attend_inputs(self.layer, query, kv_cache, metadata, kv_scale, sinks, topk_indices)
        decode_reqs, decode_rows, decode_query_len = decode_part(metadata)
        out, lse = paged_attention(
            query,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            decode_reqs=decode_reqs,
            decode_rows=decode_rows,
            decode_query_len=decode_query_len,
            max_seq_len=metadata.max_seq_len,
            sm_scale=self.layer.scale,
            causal=metadata.causal,
            sliding_window=self.layer.sliding_window,
            kv_scale=kv_scale,
            sinks=sinks,
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
        mha_kv_insert(key, value, kv_cache, slot_mapping, kv_scale)


class CudaAttnBackend(AttentionBackend):
    name = "cuda_attn"
    capabilities = CUDA_ATTN_CAPABILITIES

    @classmethod
    def availability(cls) -> Availability:
        return cuda_attn_availability()

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
        if layer.kv_lora_rank > 0:
            raise ValueError(f"cuda_attn serves MHA layers only; layer has kv_lora_rank={layer.kv_lora_rank}")
        if layer.head_size not in CUDA_ATTN_CAPABILITIES.head_sizes:
            raise ValueError(f"cuda_attn head sizes are {CUDA_ATTN_CAPABILITIES.head_sizes}, "
                             f"layer has {layer.head_size}")
        return CudaAttnImpl(layer)
