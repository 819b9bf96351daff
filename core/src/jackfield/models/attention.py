"""The attention layer a model family uses, and the per-step context every layer reads.

A layer holds one impl per role: decode rows (the first `num_decode_tokens`) go to the decode
backend's impl and the rest to the prefill backend's. When both roles name one backend they are
the same impl and the whole batch goes through it in one call. A model with KV cache groups
(sliding-window layers beside full ones) has one step context per group: each layer reads its
group's metadata (its block tables and slots differ; positions and lengths do not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
)


@dataclass(frozen=True)
class StepContext:
    """One step's attention metadata (per role when the roles' backends differ) and the caches."""

    kv_caches: list[torch.Tensor]
    metadata: AttentionMetadata | None = None  # one backend serves both roles
    decode: AttentionMetadata | None = None  # split roles: the decode half (None: no decodes)
    prefill: AttentionMetadata | None = None  # split roles: the prefill half (None: no prefills)
    num_decode_tokens: int = 0
    groups: tuple[StepContext, ...] = ()  # per KV cache group (empty: one group, this context)
    layer_group: tuple[int, ...] = ()  # per layer: its index in `groups`

    def of_layer(self, layer_index: int) -> StepContext:
        return self.groups[self.layer_group[layer_index]] if self.groups else self


@dataclass(frozen=True)
class AttentionBackends:
    """The backend chosen for each role of the target model."""

    prefill: type[AttentionBackend]
    decode: type[AttentionBackend]

    @property
    def split(self) -> bool:
        return self.prefill is not self.decode


class RoleImpls(nn.Module):
    """The impls of one layer, by role; `run` sends each half of the batch to its impl."""

    def __init__(self, backends: AttentionBackends, spec: AttentionLayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.decode_impl: AttentionImpl = backends.decode.make_impl(spec)
        self.prefill_impl: AttentionImpl = (
            backends.prefill.make_impl(spec) if backends.split else self.decode_impl
        )

    def process_weights_after_loading(self, weights: dict[str, torch.Tensor]) -> None:
        self.decode_impl.process_weights_after_loading(weights)
        if self.prefill_impl is not self.decode_impl:
            self.prefill_impl.process_weights_after_loading(weights)

    def run(self, step: StepContext, layer_index: int, *rows: torch.Tensor, **layer_args: torch.Tensor) -> torch.Tensor:
        """impl.forward(*rows, cache, metadata, **layer_args) over the whole batch, or per role half.
        `rows` are split between the halves; `layer_args` (per-layer tensors: sinks) are not."""
        cache = step.kv_caches[layer_index]
        step = step.of_layer(layer_index)
        if step.metadata is not None:
            return self.decode_impl.forward(*rows, cache, step.metadata, **layer_args)  # type: ignore[attr-defined]
        nd = step.num_decode_tokens
        parts = []
        if step.decode is not None:
            parts.append(self.decode_impl.forward(*(r[:nd] for r in rows), cache, step.decode, **layer_args))  # type: ignore[attr-defined]
        if step.prefill is not None:
            parts.append(self.prefill_impl.forward(*(r[nd:] for r in rows), cache, step.prefill, **layer_args))  # type: ignore[attr-defined]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
