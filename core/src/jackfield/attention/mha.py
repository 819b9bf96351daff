"""Multi-head attention with grouped KV heads: the base every MHA backend subclasses.

Sliding window (from the layer spec): a query at position p sees keys in (p - window, p].
Sinks (gpt-oss): per-head logits that join the softmax denominator but carry no value.
"""

from __future__ import annotations

import torch

from jackfield.attention.checks import check_cache, check_kv_scale, check_slot_mapping, check_written_rows
from jackfield.attention.kv_cache import key_scale, quantize, value_scale, write_slots
from jackfield.contracts.attention import AttentionImpl, AttentionLayerSpec, AttentionMetadata


class MHAImpl(AttentionImpl):
    kind = "mha"

    def __init__(self, layer: AttentionLayerSpec) -> None:
        super().__init__(layer)
        if layer.num_heads <= 0 or layer.num_kv_heads <= 0 or layer.num_heads % layer.num_kv_heads:
            raise ValueError(
                f"num_heads {layer.num_heads} must be a positive multiple of "
                f"num_kv_heads {layer.num_kv_heads}"
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] -> [T, H, D] in q's dtype."""
        self.write_kv(kv_cache, metadata.slot_mapping, k, v, kv_scale)
        return self.attend(q, kv_cache, metadata, kv_scale=kv_scale, sinks=sinks).out

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        lay = self.layer
        check_cache(lay, kv_cache)
        check_kv_scale(kv_cache, kv_scale)
        num_tokens = key.shape[0] if key.dim() else 0
        shape = (num_tokens, lay.num_kv_heads, lay.head_size)
        check_written_rows("key", key, shape, kv_cache)
        check_written_rows("value", value, shape, kv_cache)
        padded = check_slot_mapping(slot_mapping, num_tokens, kv_cache.shape[1] * kv_cache.shape[2])
        for half, rows, scale in ((kv_cache[0], key, key_scale(kv_scale)),
                                  (kv_cache[1], value, value_scale(kv_scale))):
            write_slots(half.flatten(0, 1), slot_mapping, quantize(rows, kv_cache.dtype, scale), padded)
