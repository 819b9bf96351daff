"""Entry-point checks shared by every impl: fail closed with a message that names the problem."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from jackfield.attention.kv_cache import ACTIVATION_DTYPES, FP8_DTYPE, is_mla, kv_scale_size
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata


def check_kv_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """An fp8 cache needs float32 per-tensor scales on the cache's device: [1] for an MLA cache,
    [2] (key, value) for an MHA cache."""
    if kv_cache.dtype != FP8_DTYPE:
        return
    if kv_scale is None:
        raise ValueError("fp8_e4m3 KV cache needs kv_scale (float32 per-tensor scales), got None")
    size = kv_scale_size(kv_cache)
    if kv_scale.dtype != torch.float32 or kv_scale.numel() != size:
        what = "(key scale, value scale) of an MHA cache" if size == 2 else "of an MLA cache"
        raise ValueError(
            f"kv_scale must be a {size}-element float32 tensor {what}, "
            f"got {kv_scale.dtype} {tuple(kv_scale.shape)}"
        )
    if kv_scale.device != kv_cache.device:
        raise ValueError(f"kv_scale is on {kv_scale.device}, the cache on {kv_cache.device}")


def check_cache(layer: AttentionLayerSpec, kv_cache: torch.Tensor) -> None:
    """Shape (the record width derived from the last dim), dtype and layout of a layer's cache."""
    if kv_cache.dtype not in (*ACTIVATION_DTYPES, FP8_DTYPE):
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not a float or fp8_e4m3 dtype")
    if layer.kv_cache_dtype == "fp8_e4m3" and kv_cache.dtype != FP8_DTYPE:
        raise ValueError(f"layer is configured fp8_e4m3 but the cache holds {kv_cache.dtype}")
    if layer.kv_cache_dtype == "bfloat16" and kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"layer is configured bfloat16 but the cache holds {kv_cache.dtype}")
    if is_mla(layer):
        width = layer.kv_lora_rank + layer.qk_rope_head_dim
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
            raise ValueError(
                f"MLA cache must be [num_blocks, block_size, {width}] (kv_lora_rank + rope dim), "
                f"got {tuple(kv_cache.shape)}"
            )
    else:
        want = (layer.num_kv_heads, layer.head_size)
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != want:
            raise ValueError(
                f"MHA cache must be [2, num_blocks, block_size, {want[0]}, {want[1]}], "
                f"got {tuple(kv_cache.shape)}"
            )
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int) -> bool:
    """int64 [num_tokens], every slot below num_slots (its range read once per tensor and
    version: every layer of a step writes through the same mapping). Returns whether the mapping
    holds padding (negative slots, which writes skip)."""
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    return _check_slot_range(
        slot_mapping, num_slots, lambda top: f"slot {top} is out of range: the cache has {num_slots} slots"
    )


def check_attend_inputs(
    layer: AttentionLayerSpec,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scale: torch.Tensor | None,
    sinks: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
) -> None:
    """Everything `attend` relies on, checked before any work."""
    check_cache(layer, kv_cache)
    check_kv_scale(kv_cache, kv_scale)
    width = layer.kv_lora_rank + layer.qk_rope_head_dim if is_mla(layer) else layer.head_size
    if query.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not one of float32, bfloat16, float16")
    if query.dim() != 3 or query.shape[1:] != (layer.num_heads, width):
        raise ValueError(f"query must be [T, {layer.num_heads}, {width}], got {tuple(query.shape)}")
    if query.device != kv_cache.device:
        raise ValueError(f"query is on {query.device}, the cache on {kv_cache.device}")
    num_tokens = query.shape[0]
    block_size = kv_cache.shape[1] if is_mla(layer) else kv_cache.shape[2]
    _CheckedMetadata.check(metadata, num_tokens, block_size)
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (layer.num_heads,)):
        raise ValueError(f"sinks must be float32 [{layer.num_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    if topk_indices is not None and (
        topk_indices.dtype != torch.int32 or topk_indices.dim() != 2 or topk_indices.shape[0] != num_tokens
    ):
        raise ValueError(
            f"topk_indices must be int32 [{num_tokens}, K], "
            f"got {topk_indices.dtype} {tuple(topk_indices.shape)}"
        )


def _check_metadata(metadata: AttentionMetadata, num_tokens: int, block_size: int) -> None:
    """The step's request layout against `num_tokens` query rows and a cache of `block_size`."""
    qsl = metadata.query_start_loc_cpu
    if qsl.numel() != metadata.num_reqs + 1 or int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc {qsl.tolist()} does not describe {num_tokens} query rows of "
            f"{metadata.num_reqs} requests"
        )
    q_lens = qsl.diff()
    if bool((q_lens < 0).any()) or bool((q_lens > metadata.seq_lens_cpu).any()):
        raise ValueError(
            f"query lengths {q_lens.tolist()} must be in [0, seq_lens {metadata.seq_lens_cpu.tolist()}]"
        )
    if metadata.block_table.dim() != 2 or metadata.block_table.shape[0] != metadata.num_reqs:
        raise ValueError(
            f"block_table must be [{metadata.num_reqs}, max_blocks], got {tuple(metadata.block_table.shape)}"
        )
    longest = int(metadata.seq_lens_cpu.max()) if metadata.num_reqs else 0
    if metadata.block_table.shape[1] * block_size < longest:
        raise ValueError(
            f"block_table has {metadata.block_table.shape[1]} blocks of {block_size} per request, "
            f"too few for seq_len {longest}"
        )


class _CheckedMetadata:
    """The metadata `_check_metadata` passed lately, by identity (no strong reference) and the
    versions of the host tensors it read: every layer of a step attends with the same metadata,
    so its layout is read (a dozen small host ops) once a step rather than once a layer. A step
    split by role or by KV cache group holds a few, hence a few entries."""

    MAX_ENTRIES = 8
    passed: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}

    @classmethod
    def check(cls, metadata: AttentionMetadata, num_tokens: int, block_size: int) -> None:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        if qsl.is_inference() or seq_lens.is_inference():  # no version counters: check every call
            _check_metadata(metadata, num_tokens, block_size)
            return
        state = (qsl._version, seq_lens._version, *metadata.block_table.shape, num_tokens, block_size)
        entry = cls.passed.get(id(metadata))
        if entry is not None and entry[0]() is metadata and entry[1] == state:
            return
        _check_metadata(metadata, num_tokens, block_size)
        if len(cls.passed) >= cls.MAX_ENTRIES:
            cls.passed.clear()
        cls.passed[id(metadata)] = (weakref.ref(metadata), state)


def check_written_rows(name: str, rows: torch.Tensor, shape: tuple[int, ...], kv_cache: torch.Tensor) -> None:
    """A key/value tensor handed to write_kv: float, the expected shape, the cache's device."""
    if rows.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} dtype {rows.dtype} is not one of float32, bfloat16, float16")
    if tuple(rows.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(rows.shape)}")
    if rows.device != kv_cache.device:
        raise ValueError(f"{name} is on {rows.device}, the cache on {kv_cache.device}")


class _LastCheckedSlots:
    """The last slot_mapping whose range passed, by identity and version (no strong reference),
    and whether it holds padding."""

    tensor: weakref.ref | None = None
    version: int = -1
    capacity: int = -1
    padded: bool = True


def _check_slot_range(slot_mapping: torch.Tensor, capacity: int, too_large: Callable[[int], str]) -> bool:
    """Raises ValueError(too_large(slot)) for a slot >= capacity; returns whether the mapping
    holds negative (padding) slots. Read once per (tensor, version, capacity): inference-mode
    tensors carry no version counter, so they are read on every call."""
    if not slot_mapping.numel():
        return False
    last = _LastCheckedSlots
    if (not slot_mapping.is_inference() and last.tensor is not None and last.tensor() is slot_mapping
            and last.version == slot_mapping._version and last.capacity == capacity):
        return last.padded
    return _read_slot_range(slot_mapping, slot_mapping, capacity, too_large)  # the one device sync


def _read_slot_range(slot_mapping: torch.Tensor, values: torch.Tensor, capacity: int,
                     too_large: Callable[[int], str]) -> bool:
    """`values` (slot_mapping itself, or its host copy) checked against capacity and remembered
    as slot_mapping's range; returns whether it holds padding."""
    low, top = torch.stack(torch.aminmax(values)).tolist()
    if top >= capacity:
        raise ValueError(too_large(top))
    if not slot_mapping.is_inference():
        last = _LastCheckedSlots
        last.tensor, last.version, last.capacity = weakref.ref(slot_mapping), slot_mapping._version, capacity
        last.padded = low < 0
    return low < 0


def check_slots_on_host(slot_mapping: torch.Tensor, host_slots: torch.Tensor, capacity: int) -> None:
    """`slot_mapping` (on its device) is a copy of `host_slots`, which the caller built on the
    host: their range is checked there (ValueError for a slot >= capacity) and remembered as
    `slot_mapping`'s, so the kernels' own check of it (once per tensor, version and capacity) has
    nothing to read back from the device. A drafter's eager rows would otherwise wait for the
    device once a forward."""
    if host_slots.numel():
        _read_slot_range(slot_mapping, host_slots, capacity,
                         lambda top: f"slot {top} is out of range: the cache has {capacity} slots")


def check_slot_range_once(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """slot_mapping's largest slot is inside the cache's num_blocks x block_size slots, checked once
    per (tensor, version, capacity).

    Every layer of a step inserts with the same slot_mapping, so a kernel's insert pays the one
    device sync once a step, not once a layer. Skipped while a CUDA graph records (it cannot sync:
    the recording engine checks the slots of every replay on the host), so the kernels themselves
    must never write a slot outside the cache.
    """
    if slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    capacity = num_blocks * block_size
    _check_slot_range(slot_mapping, capacity, lambda top: f"slot_mapping holds slot {top}, but the cache has "
                      f"{capacity} slots ({num_blocks} x {block_size})")
