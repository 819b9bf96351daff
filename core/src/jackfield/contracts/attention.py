"""The attention-backend contract.

A backend is a class with a frozen capability record (data any tool can read without running a
kernel), an availability probe, a metadata builder and a per-layer impl. The engine never looks
inside a backend; it only calls what is declared here.

Tensor layout shared by every backend (one step = a flat batch of new tokens, decodes first):
  query            [T, H, D]                   T new tokens of B requests, contiguous by request
  MLA kv_cache     [num_blocks, block_size, kv_lora_rank + rope_dim]   latent ‖ rope key
  MHA kv_cache     [2, num_blocks, block_size, H_kv, D]               key, value
  query_start_loc  [B + 1] int32               request b owns query rows qsl[b]:qsl[b+1]
  seq_lens         [B] int32                   KV length of b after this step's tokens are written
  block_table      [B, max_blocks] int32       request-local block j -> physical block
  slot_mapping     [T] int64                   physical slot (block * block_size + offset); < 0: skip
Query row i of request b sits at position seq_lens[b] - q_len_b + i. Causal: it sees keys at
positions <= its own. Non-causal: it sees all seq_lens[b] keys.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from jackfield.contracts.recurrent import RecurrentStep

AttentionKind = Literal["mla", "mha"]
KVCacheDType = Literal["auto", "bfloat16", "fp8_e4m3"]
CudaGraphSupport = Literal["never", "uniform_decode", "always"]


@dataclass(frozen=True)
class Availability:
    """The answer of an availability probe: fail closed, always with a reason."""

    ok: bool
    reason: str

    @classmethod
    def yes(cls, reason: str = "available") -> Availability:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend supports, as data. Empty tuples mean "none"; `None` head sizes mean "any"."""

    kinds: tuple[AttentionKind, ...]
    activation_dtypes: tuple[torch.dtype, ...]
    kv_cache_dtypes: tuple[KVCacheDType, ...]
    head_sizes: tuple[int, ...] | None  # MLA: kv_lora_rank + rope_dim; MHA: head_dim; None: any
    block_size_multiple: int
    devices: tuple[str, ...]  # torch device types: "cuda", "cpu", ...
    sliding_window: bool = False
    sinks: bool = False
    sparse_topk: bool = False
    non_causal: bool = False
    dcp: bool = False  # returns the per-head LSE so decode context parallel can merge partials
    max_decode_query_len: int = 1
    # "uniform_decode": decode and verify steps (q query rows per request, the same q for every
    # request, q <= max_decode_query_len) may be recorded in a CUDA graph: the decode path reads
    # lengths and tables from the device tensors only (the metadata's Python values are upper
    # bounds then), never syncs, places a request's row i at position seq_len - q + i, gives a
    # request with seq_len 0 output 0 and writes nothing for slot -1. "always": prefill too (no
    # engine records prefill yet).
    cuda_graph: CudaGraphSupport = "never"
    preferred_block_size: int | None = None


@dataclass(frozen=True)
class AttentionRequirements:
    """What one role (target/drafter, prefill/decode) of a model needs from its backend."""

    kind: AttentionKind
    dtype: torch.dtype
    head_size: int
    block_size: int | None  # None: not fixed yet (the engine then picks one the backend allows)
    device: str
    kv_cache_dtype: KVCacheDType = "auto"
    sliding_window: bool = False
    sinks: bool = False
    sparse_topk: bool = False
    non_causal: bool = False
    dcp: bool = False
    max_decode_query_len: int = 1


def capability_mismatches(caps: AttentionCapabilities, req: AttentionRequirements) -> list[str]:
    """Every way `req` exceeds `caps` (empty when the capabilities allow it)."""
    reasons: list[str] = []
    if req.kind not in caps.kinds:
        reasons.append(f"attention kind {req.kind!r} not supported (backend serves {list(caps.kinds)})")
    if req.dtype not in caps.activation_dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in caps.activation_dtypes)
        reasons.append(f"activation dtype {str(req.dtype).removeprefix('torch.')} not in [{names}]")
    if req.kv_cache_dtype not in caps.kv_cache_dtypes:
        reasons.append(f"kv_cache_dtype {req.kv_cache_dtype!r} not in {list(caps.kv_cache_dtypes)}")
    if caps.head_sizes is not None and req.head_size not in caps.head_sizes:
        reasons.append(f"head size {req.head_size} not in {list(caps.head_sizes)}")
    if req.block_size is not None and (req.block_size <= 0 or req.block_size % caps.block_size_multiple):
        reasons.append(f"block size {req.block_size} is not a multiple of {caps.block_size_multiple}")
    if req.device not in caps.devices:
        reasons.append(f"device {req.device!r} not in {list(caps.devices)}")
    for feature in ("sliding_window", "sinks", "sparse_topk", "non_causal", "dcp"):
        if getattr(req, feature) and not getattr(caps, feature):
            reasons.append(f"{feature} not supported")
    if req.max_decode_query_len > caps.max_decode_query_len:
        reasons.append(
            f"decode query length {req.max_decode_query_len} exceeds the backend's "
            f"{caps.max_decode_query_len}"
        )
    return reasons


@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer of one step shares. Built once per step by the engine.

    Host copies (`*_cpu`) exist so Python-level planning never syncs the device.
    `num_decodes` requests (and their `num_decode_tokens` rows) come first in the batch.
    `extra` holds a backend's own precomputed plan (gather indices, split plans, masks).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    num_decode_tokens: int = 0
    causal: bool = True
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    def replace(self, **changes: object) -> AttentionMetadata:
        return dataclasses.replace(self, **changes)


class AttentionMetadataBuilder:
    """Turns the engine's common metadata into a backend's metadata, once per step.

    `build(common, for_capture=True)` is used while recording a CUDA graph. It must return
    fresh objects and never mutate state that a later run-time build reads (buffers the
    run-time path writes into are the backend's own and must not alias capture state).
    The default adds nothing.
    """

    def build(self, common: AttentionMetadata, for_capture: bool = False) -> AttentionMetadata:
        return common


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Per-layer facts an impl is built from."""

    num_heads: int
    head_size: int  # MHA: head_dim. MLA: kv_lora_rank + rope_dim (the latent record width)
    scale: float
    num_kv_heads: int = 1
    kv_cache_dtype: KVCacheDType = "auto"
    sliding_window: int | None = None  # tokens a query sees, itself included
    # MLA only
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class AttentionOutput:
    out: torch.Tensor  # [T, H, Dv]
    lse: torch.Tensor | None  # [T, H] float32 natural-log sum-exp; -inf for rows that saw no key


class AttentionImpl(ABC):
    """One layer's attention. Subclasses: `MLAImpl`, `MHAImpl` (in jackfield.attention)."""

    kind: ClassVar[AttentionKind]

    def __init__(self, layer: AttentionLayerSpec) -> None:
        self.layer = layer

    def process_weights_after_loading(self, weights: dict[str, torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """Prepare weights this impl owns (MLA: split kv_b_proj into W_UK / W_UV). Default: a
        deliberate no-op hook, so impls without weights of their own need not override it."""

    @abstractmethod
    def write_kv(
        self,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Insert KV for tokens at `slot_mapping` (slots < 0 skipped), with no queries.

        MLA: key = kv_c [T, kv_lora_rank], value = k_pe [T, rope_dim].
        MHA: key, value = [T, H_kv, D]. fp8 caches quantize with `kv_scale` (required).
        """

    @abstractmethod
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
        """Attention of `query` over the paged cache (which already holds this step's KV).

        MLA: query is [T, H, kv_lora_rank + rope_dim] in the absorbed (latent) form, output
        [T, H, kv_lora_rank]. MHA: query [T, H, D], output [T, H, D].
        `topk_indices` [T, K] int32: request-local key positions each query attends to
        (-1 = unused); rows with none give output 0 and LSE -inf.
        `sinks` [H] float32: per-head logits added to the softmax denominator only.
        """


class AttentionBackend(ABC):
    """A named set of kernels. Class-level: no instance state, nothing runs at import."""

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether this machine can run the backend; fails closed with a reason."""

    @classmethod
    def supports_non_causal(
        cls, device: torch.device | str, kv_cache_dtype: KVCacheDType = "auto", query_len: int = 1
    ) -> bool:
        """Whether this machine attends non-causally on `device`, over a `kv_cache_dtype` cache, to
        a decode batch whose longest request has `query_len` query rows. For answers that depend
        on the machine (a library's signature, a per-arch kernel list); default: the record."""
        return cls.capabilities.non_causal

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        """Every reason this backend cannot serve `req` on this machine (empty: it can)."""
        reasons = capability_mismatches(cls.capabilities, req)
        available = cls.availability()
        if not available.ok:
            reasons.append(f"unavailable: {available.reason}")
        elif req.non_causal and cls.capabilities.non_causal:
            # any decode batch up to the longest query the requirements allow may come
            lengths = range(1, req.max_decode_query_len + 1)
            refused = [q for q in lengths if not cls.supports_non_causal(req.device, req.kv_cache_dtype, q)]
            if refused:
                reasons.append(f"non_causal not supported on {req.device} with kv_cache_dtype "
                               f"{req.kv_cache_dtype!r} for decode query lengths {refused}")
        return reasons

    @classmethod
    def metadata_builder(cls) -> AttentionMetadataBuilder:
        return AttentionMetadataBuilder()

    @classmethod
    @abstractmethod
    def make_impl(cls, layer: AttentionLayerSpec) -> AttentionImpl: ...


Role = Literal["decode", "prefill"]


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
    # per KV cache (as kv_caches): an fp8 cache's scales, the `kv_scale` its impl takes ([1] MLA,
    # [2] key and value MHA), None for other caches; empty: no fp8 cache
    kv_scales: Sequence[torch.Tensor | None] = ()
    # set the fp8 scales from the KV each layer writes, in place, before writing it (the engine's
    # first prefill when the scales are calibrated: amax / 448)
    calibrate_kv_scales: bool = False
    # a hybrid model's recurrent layers: the step's metadata (built once) and their state slots
    recurrent: RecurrentStep | None = None

    def parts(self, layer_index: int) -> tuple[BatchPart, ...]:
        """The parts of the batch as `layer_index` sees them (its KV cache group's metadata)."""
        return self.groups[self.layer_group[layer_index] if self.layer_group else 0]

    def kv_scale(self, layer_index: int) -> torch.Tensor | None:
        """KV cache `layer_index`'s fp8 scales (None: not an fp8 cache)."""
        return self.kv_scales[layer_index] if self.kv_scales else None


@dataclass(frozen=True)
class AttentionBackends:
    """The backend chosen for each role of the target model."""

    prefill: type[AttentionBackend]
    decode: type[AttentionBackend]

    @property
    def split(self) -> bool:
        return self.prefill is not self.decode
