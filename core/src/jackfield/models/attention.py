"""The attention layer a model family uses, and the per-step context every layer reads.

A step's batch is divided by role (decode rows first, then prefill rows) in one place,
`StepContextBuilder`: per KV cache group it builds either one metadata for the whole batch or
one per role half, each half through its role's own metadata builder. It divides a group when
the roles name different backends, or when the group's layers are MLA (there the role picks the
math: the absorbed form for decode rows, the expanded form for prefill rows). A layer holds one
impl per role (`RoleImpls`) and sends each part of the batch to its role's impl. A model with KV
cache groups (sliding-window layers beside full ones) has one set of parts per group: each layer
reads its group's (their block tables and slots differ; positions and lengths do not).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from jackfield.attention.metadata import split_decode_prefill
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
)

Role = Literal["decode", "prefill"]
EVERY_ROW = slice(None)


@dataclass(frozen=True)
class AttentionBackends:
    """The backend chosen for each role of the target model."""

    prefill: type[AttentionBackend]
    decode: type[AttentionBackend]

    @property
    def split(self) -> bool:
        return self.prefill is not self.decode


@dataclass(frozen=True)
class BatchPart:
    """Rows of one step's batch that one impl serves, and their metadata."""

    rows: slice  # EVERY_ROW when this part is the whole batch
    metadata: AttentionMetadata
    role: Role | None  # the role whose impl serves the rows; None: one impl serves both roles


@dataclass(frozen=True)
class StepContext:
    """One step's attention metadata, as parts of the batch per KV cache group, and the caches."""

    kv_caches: list[torch.Tensor]
    groups: tuple[tuple[BatchPart, ...], ...]  # per KV cache group: its batch's parts, decode rows first
    layer_group: tuple[int, ...] = ()  # per layer: its index in `groups` (empty: one group)

    def parts(self, layer_index: int) -> tuple[BatchPart, ...]:
        """The parts of the batch as `layer_index` sees them (its KV cache group's metadata)."""
        return self.groups[self.layer_group[layer_index] if self.layer_group else 0]


def splits_by_role(backends: AttentionBackends, layers: Sequence[AttentionLayerSpec]) -> bool:
    """Whether a KV cache group's batch is divided by role: when the roles name different
    backends, or when the group's layers are MLA (kv_lora_rank > 0), whose impls compute decode
    and prefill rows in different forms. An MHA group served by one backend is one part."""
    return backends.split or any(layer.kv_lora_rank > 0 for layer in layers)


class StepContextBuilder:
    """Builds each step's StepContext from its per-group common metadata: the one place a batch
    is divided by role. Used for every step the runner runs and for the decode CUDA-graph capture."""

    def __init__(self, backends: AttentionBackends, layers: Sequence[AttentionLayerSpec],
                 layer_group: Sequence[int]) -> None:
        """`layers`: the model's KV cache layers; `layer_group`: per layer, its KV cache group."""
        num_groups = max(layer_group) + 1
        self.layer_group = tuple(layer_group) if num_groups > 1 else ()
        group_layers: list[list[AttentionLayerSpec]] = [[] for _ in range(num_groups)]
        for layer, group in zip(layers, layer_group, strict=True):
            group_layers[group].append(layer)
        self.by_role = [splits_by_role(backends, group) for group in group_layers]
        # (decode, prefill) builders per group. A divided group has one builder per role, even on
        # one backend: a builder may reuse its buffers per build (as vLLM's), so one builder never
        # builds both halves of a step.
        self.builders: list[tuple[AttentionMetadataBuilder, AttentionMetadataBuilder]] = []
        for by_role in self.by_role:
            decode = backends.decode.metadata_builder()
            self.builders.append((decode, backends.prefill.metadata_builder() if by_role else decode))

    def build(self, kv_caches: list[torch.Tensor], per_group: Sequence[AttentionMetadata],
              for_capture: bool = False) -> StepContext:
        """The step's context from each group's common metadata (decodes first)."""
        if len(per_group) != len(self.builders):
            raise ValueError(f"{len(per_group)} metadata for {len(self.builders)} KV cache groups")
        parts = tuple(self._parts(g, common, for_capture) for g, common in enumerate(per_group))
        return StepContext(kv_caches, parts, self.layer_group)

    def _parts(self, group: int, common: AttentionMetadata, for_capture: bool) -> tuple[BatchPart, ...]:
        decode_builder, prefill_builder = self.builders[group]
        if not self.by_role[group]:
            return (BatchPart(EVERY_ROW, decode_builder.build(common, for_capture), None),)
        # A step of one role is its own half: no slicing (decode-only steps are the hot path).
        if common.num_decodes == common.num_reqs:
            return (BatchPart(EVERY_ROW, decode_builder.build(common, for_capture), "decode"),)
        if common.num_decodes == 0:
            return (BatchPart(EVERY_ROW, prefill_builder.build(common, for_capture), "prefill"),)
        decode, prefill = split_decode_prefill(common)
        assert decode is not None and prefill is not None  # both roles have requests
        nd = common.num_decode_tokens
        return (BatchPart(slice(0, nd), decode_builder.build(decode, for_capture), "decode"),
                BatchPart(slice(nd, None), prefill_builder.build(prefill, for_capture), "prefill"))


class RoleImpls(nn.Module):
    """The impls of one layer, by role; the only dispatcher of a step's rows to impls."""

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

    def impl(self, role: Role | None) -> AttentionImpl:
        """The impl serving `role` (None: the one impl of both roles)."""
        return self.prefill_impl if role == "prefill" else self.decode_impl

    def parts(
        self, step: StepContext, layer_index: int
    ) -> Iterator[tuple[slice, AttentionImpl, AttentionMetadata]]:
        """(rows, impl, metadata) for each part of the step's batch, decode rows first. A layer
        that needs per-part work before attention (DeepSeek-V3.2's indexer) loops over these."""
        for part in step.parts(layer_index):
            yield part.rows, self.impl(part.role), part.metadata

    def run(
        self, step: StepContext, layer_index: int, *rows: torch.Tensor, **layer_args: torch.Tensor
    ) -> torch.Tensor:
        """impl.forward(*rows, cache, metadata, **layer_args) per part of the batch, concatenated.
        `rows` are divided between the parts; `layer_args` (per-layer tensors: sinks) are not."""
        cache = step.kv_caches[layer_index]
        parts = step.parts(layer_index)
        if len(parts) == 1:  # the whole batch (every decode-only step): no slicing
            part = parts[0]
            return self.impl(part.role).forward(*rows, cache, part.metadata, **layer_args)  # type: ignore[attr-defined]
        return torch.cat([
            self.impl(part.role).forward(*(r[part.rows] for r in rows), cache, part.metadata, **layer_args)  # type: ignore[attr-defined]
            for part in parts
        ])
