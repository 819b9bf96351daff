"""The attention layer a model family uses, and the per-step context every layer reads.

A step's batch is divided by role (decode rows first, then prefill rows) in one place,
`jackfield.attention.metadata.GroupMetadataBuilder`: per KV cache group it builds either one
metadata for the whole batch or one per role half, each half through its role's own metadata
builder. `StepContextBuilder` holds one per group and builds the StepContext every layer reads.
A layer holds one impl per role (`RoleImpls`), the only dispatcher of rows to impls: it sends each
part of the batch to its role's impl. A model with KV cache groups (sliding-window layers beside
full ones) has one set of parts per group: each layer reads its group's (their block tables and
slots differ; positions and lengths do not).
Under decode context parallelism the rows go through jackfield.distributed.dcp instead (decode
rows: each rank attends its part of the KV, the parts merged by LSE; prefill requests: their
context gathered from the ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from jackfield.attention.kv_cache import calibrated_kv_scale, is_mla
from jackfield.attention.metadata import GroupMetadataBuilder
from jackfield.attention.mla import MLAImpl
from jackfield.contracts.attention import (
    AttentionBackends,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    Role,
    StepContext,
)
from jackfield.distributed.cp_common import parallel_state
from jackfield.distributed.dcp import attend_mha, attend_mla


class StepContextBuilder:
    """Builds each step's StepContext from its per-group common metadata, each group through its
    GroupMetadataBuilder (which divides the batch by role). Used for every step the runner runs
    and for the decode CUDA-graph capture."""

    def __init__(self, backends: AttentionBackends, layers: Sequence[AttentionLayerSpec],
                 layer_group: Sequence[int]) -> None:
        """`layers`: the model's KV cache layers; `layer_group`: per layer, its KV cache group."""
        num_groups = max(layer_group) + 1
        self.layer_group = tuple(layer_group) if num_groups > 1 else ()
        group_layers: list[list[AttentionLayerSpec]] = [[] for _ in range(num_groups)]
        for layer, group in zip(layers, layer_group, strict=True):
            group_layers[group].append(layer)
        self.groups = [GroupMetadataBuilder(backends.decode, backends.prefill, g) for g in group_layers]

    def build(self, kv_caches: list[torch.Tensor], per_group: Sequence[AttentionMetadata],
              for_capture: bool = False, kv_scales: Sequence[torch.Tensor | None] = (),
              calibrate_kv_scales: bool = False) -> StepContext:
        """The step's context from each group's common metadata (decodes first); `kv_scales` per
        KV cache as StepContext holds them."""
        if len(per_group) != len(self.groups):
            raise ValueError(f"{len(per_group)} metadata for {len(self.groups)} KV cache groups")
        parts = tuple(g.build(common, for_capture) for g, common in zip(self.groups, per_group, strict=True))
        return StepContext(kv_caches, parts, self.layer_group, kv_scales, calibrate_kv_scales)


class RoleImpls(nn.Module):
    """The impls of one layer, by role; the only dispatcher of a step's rows to impls."""

    def __init__(self, backends: AttentionBackends, spec: AttentionLayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.decode_impl: AttentionImpl = backends.decode.make_impl(spec)
        self.prefill_impl: AttentionImpl = (
            backends.prefill.make_impl(spec) if backends.split else self.decode_impl
        )
        groups = parallel_state()
        self.dcp = groups if groups.dcp_size > 1 else None  # None: this rank holds every token's KV

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

    def kv_scale(self, step: StepContext, layer_index: int, key: torch.Tensor,
                 value: torch.Tensor) -> torch.Tensor | None:
        """The layer's fp8 scales for this step (None: not an fp8 cache), first set from the `key`
        and `value` rows it is about to write when the step calibrates (MLA: kv_c and k_pe)."""
        scale = step.kv_scale(layer_index)
        if scale is not None and step.calibrate_kv_scales:
            scale.copy_(calibrated_kv_scale(key, value, is_mla(self.spec)))
        return scale

    def run(
        self, step: StepContext, layer_index: int, *rows: torch.Tensor, **layer_args: torch.Tensor
    ) -> torch.Tensor:
        """impl.forward(*rows, cache, metadata, kv_scale=, **layer_args) per part of the batch,
        concatenated. `rows` (query, key, value) are divided between the parts; `layer_args`
        (per-layer tensors: sinks) are not."""
        cache = step.kv_caches[layer_index]
        parts = step.parts(layer_index)
        scale = self.kv_scale(step, layer_index, rows[1], rows[2])
        if self.dcp is not None:  # one part, decode rows and prefill requests (jackfield.distributed.dcp)
            if layer_args:
                raise ValueError(f"decode context parallel does not take {sorted(layer_args)} "
                                 "(refused at start-up)")
            (part,) = parts
            attend = attend_mla if isinstance(self.decode_impl, MLAImpl) else attend_mha
            return attend(self.decode_impl, self.prefill_impl, *rows, cache, part.metadata, scale,  # type: ignore[operator]
                          self.dcp)
        if scale is not None:
            layer_args = {**layer_args, "kv_scale": scale}
        if len(parts) == 1:  # the whole batch (every decode-only step): no slicing
            part = parts[0]
            return self.impl(part.role).forward(*rows, cache, part.metadata, **layer_args)  # type: ignore[attr-defined]
        return torch.cat([
            self.impl(part.role).forward(*(r[part.rows] for r in rows), cache, part.metadata, **layer_args)  # type: ignore[attr-defined]
            for part in parts
        ])
