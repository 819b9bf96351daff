"""The reference backend: plain PyTorch, float32 accumulation, one request at a time. The oracle."""

from __future__ import annotations

import torch

from jackfield.attention.checks import check_attend_inputs
from jackfield.attention.kv_cache import dequantize, is_mla, key_scale, request_slots, value_scale
from jackfield.attention.mha import MHAImpl
from jackfield.attention.mla import MLAImpl
from jackfield.builtins import TORCH_REF_CAPABILITIES
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionOutput,
    Availability,
)
from jackfield.ops.reference import dense_attention, visibility_mask


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_size: int,
    metadata: AttentionMetadata,
    scale: float,
    *,
    kv_scale: torch.Tensor | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, Dk] over flat slot tensors keys [slots, Hkv, Dk], values [slots, Hkv, Dv].

    Returns out [T, H, Dv] float32 and lse [T, H] float32.
    """
    out = torch.empty(
        query.shape[0], query.shape[1], values.shape[-1], dtype=torch.float32, device=query.device
    )
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    qsl = metadata.query_start_loc_cpu.tolist()
    for b, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        if q0 == q1:
            continue
        slots = request_slots(metadata.block_table[b], seq_len, block_size)
        k, v = dequantize(keys[slots], key_scale(kv_scale)), dequantize(values[slots], value_scale(kv_scale))
        if topk_indices is None:
            visible = visibility_mask(
                q1 - q0, seq_len, causal=metadata.causal, sliding_window=sliding_window, device=query.device
            )
        else:  # attend exactly the listed positions: the indexer already chose visible ones
            visible = _topk_mask(topk_indices[q0:q1], seq_len)
        out[q0:q1], lse[q0:q1] = dense_attention(query[q0:q1], k, v, scale, visible, sinks)
    return out, lse


def _topk_mask(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    if bool((indices >= seq_len).any()) or bool((indices < -1).any()):
        raise ValueError(
            f"topk_indices must be in [-1, seq_len={seq_len}), got {indices.min()}..{indices.max()}"
        )
    visible = torch.zeros(indices.shape[0], seq_len + 1, dtype=torch.bool, device=indices.device)
    visible.scatter_(
        1, torch.where(indices < 0, seq_len, indices).long(), True
    )  # -1 lands in a dropped column
    return visible[:, :seq_len]


class TorchRefMLAImpl(MLAImpl):
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
        flat = kv_cache.flatten(0, 1)  # [slots, L+R]: the record is the key, its latent part the value
        out, lse = paged_attention(
            query,
            flat[:, None, :],
            flat[:, None, : self.layer.kv_lora_rank],
            kv_cache.shape[1],
            metadata,
            self.layer.scale,
            kv_scale=kv_scale,
            sliding_window=self.layer.sliding_window,
            sinks=sinks,
            topk_indices=topk_indices,
        )
        return AttentionOutput(out.to(query.dtype), lse if return_lse else None)


class TorchRefMHAImpl(MHAImpl):
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
        out, lse = paged_attention(
            query,
            kv_cache[0].flatten(0, 1),
            kv_cache[1].flatten(0, 1),
            kv_cache.shape[2],
            metadata,
            self.layer.scale,
            kv_scale=kv_scale,
            sliding_window=self.layer.sliding_window,
            sinks=sinks,
            topk_indices=topk_indices,
        )
        return AttentionOutput(out.to(query.dtype), lse if return_lse else None)


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    capabilities = TORCH_REF_CAPABILITIES

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes("plain PyTorch runs on every device")

    @classmethod
    def make_impl(cls, layer: AttentionLayerSpec) -> AttentionImpl:
        return TorchRefMLAImpl(layer) if is_mla(layer) else TorchRefMHAImpl(layer)
