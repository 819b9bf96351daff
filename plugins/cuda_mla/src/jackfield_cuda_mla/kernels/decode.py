"""Absorbed MLA decode over the paged latent cache: validation, split planning, launch.

`mla_decode` serves dense decode (q_len >= 1 per request, causal or not) and sparse top-k decode
(per query token a list of request-local key positions). It returns the output and the per-head
natural-log LSE, so partial results from decode context parallel ranks can be merged.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

import torch
import triton
from jackfield.ops.launch import DirectLauncher
from triton.tools.tensor_descriptor import TensorDescriptor

from jackfield_cuda_mla.kernels.checks import FP8, check_cache, check_device, check_scale, require
from jackfield_cuda_mla.kernels.decode_kernels import mla_decode_stage1
from jackfield_cuda_mla.kernels.decode_merge import mla_decode_stage2

# Gluon's API moves between releases (Triton 3.5 has no gl.num_warps and another warp_specialize
# signature), and a kernel that fails to compile would fail the call, not fall back: the Gluon
# kernels run only on the releases they are built and checked with, 3.6 (the H200 image) to 3.9 (CI).
GLUON_TRITON_RANGE = ((3, 6), (3, 9))


def gluon_supported(triton_version: str) -> bool:
    """Whether this Triton release is one the Hopper Gluon kernels are written against."""
    release = re.match(r"(\d+)\.(\d+)", triton_version)
    if release is None:
        return False
    low, high = GLUON_TRITON_RANGE
    return low <= (int(release[1]), int(release[2])) <= high


decode_gluon_few = decode_gluon_many = None  # without them every call takes the Triton kernel
decode_gluon_fp8 = None  # without it fp8 caches take the Triton kernel
if gluon_supported(triton.__version__):
    try:
        from jackfield_cuda_mla.kernels import decode_gluon_few, decode_gluon_many
    except (ImportError, AttributeError):  # a build without Gluon's Hopper modules
        decode_gluon_few = decode_gluon_many = None
    else:
        try:
            from jackfield_cuda_mla.kernels import decode_gluon_fp8
        except (ImportError, AttributeError):
            decode_gluon_fp8 = None

LOG2E = 1.4426950408889634
# Triton's per-call dispatch costs more host time than a decode step's kernels take on the GPU
# (jackfield.ops.launch); the Gluon modules keep their own launchers.
_launch_stage1 = DirectLauncher(mla_decode_stage1)
_launch_stage2 = DirectLauncher(mla_decode_stage2)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and launch width of stage 1."""

    block_m: int  # rows (query token x head pairs) per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    prefetch: bool = False  # double-buffer KV tiles in registers (for fp8, whose tile is converted)
    tma: bool = False  # dense, 16-bit or fp8 cache with PAGE % block_n == 0: whole tiles by TMA
    swap: bool = False  # keys as the M dimension of both products (few rows: wgmma needs M = 64)
    ctas_per_sm: int = 1  # programs of this tile that fit on one SM at once: plan_splits' wave size
    # Hopper: the Gluon kernel for this many rows (decode_gluon_few.py, or decode_gluon_fp8.py over
    # an fp8 cache: <= 32 rows, their own tile; decode_gluon_many.py: 64-row blocks, block_n keys a
    # tile in num_stages buffers) where the call fits it; anywhere else the Triton kernel runs with
    # the fields above.
    gluon: bool = False


@functools.cache  # a handful of distinct calls; the dataclass is frozen
def default_config(
    rows_per_group: int, on_gpu: bool, cache_dtype: torch.dtype = torch.bfloat16, sparse: bool = False
) -> DecodeConfig:
    # Many rows (H=128): a 64-row tile keeps the 64 x 512 fp32 accumulator at 128 registers a thread
    # over 8 warps. Few rows (H=16, memory-bound): one program covers every head of a request, so
    # each KV tile is read once. H200 sweeps (PERF_NOTES.md): for 16-bit caches, 64-key TMA pages;
    # with at most 32 rows the swapped products (keys as wgmma's M) on one warpgroup beat mma.sync
    # over 8 warps; fp8 won with register prefetch and no compiler pipelining (H16: 32-key tiles,
    # two programs per SM).
    block_m = max(16, min(64, triton.next_power_of_2(rows_per_group)))
    if not on_gpu:
        return DecodeConfig(block_m, 16, 4, 1)
    # The tile fields stay the Triton kernel's choice: it runs wherever the Gluon kernel does not apply.
    gluon = block_m <= 32 and not sparse and cache_dtype in (torch.bfloat16, FP8)
    if cache_dtype == FP8 and block_m == 16:
        # 32-key tiles on 4 warps: two programs per SM hide each other's conversion latency
        return DecodeConfig(block_m, 32, 4, 1, prefetch=True, ctas_per_sm=2, gluon=gluon)
    if cache_dtype == FP8:
        return DecodeConfig(block_m, 64, 8, 1, prefetch=True, gluon=gluon)
    if block_m <= 32 and not sparse and cache_dtype.itemsize == 2:
        return DecodeConfig(block_m, 64, 4, 3, tma=True, swap=True, gluon=gluon)
    if not sparse and cache_dtype.itemsize == 2:
        # Gluon where it fits (H a multiple of 64): PV of tile t - 1 and QK of tile t back to back
        # as async wgmma, tile t + 1 loading while QK runs (H200 H128: 348 us vs 533 us)
        return DecodeConfig(block_m, 64, 8, 2, tma=True, gluon=True)
    return DecodeConfig(block_m, 64, 8, 2, tma=True)


def plan_splits(programs: int, max_keys: int, block_n: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """KV splits so that programs x splits about fills one wave of the GPU, each split >= 4 tiles.

    One full wave (num_sms x ctas_per_sm programs), not more: on the H200 extra splits cost more
    (partials, merge) than the tail they remove once every SM already streams KV (PERF_NOTES.md).
    """
    wanted = max(1, round(num_sms * ctas_per_sm / max(programs, 1)))
    useful = max(1, triton.cdiv(max_keys, 4 * block_n))
    return max(1, min(wanted, useful, 64))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check_int(name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    require(t.dim() == dims, lambda: f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    require(t.dtype == torch.int32, lambda: f"{name} dtype {t.dtype} must be int32")
    require(
        t.stride(-1) == 1,
        lambda: f"{name} must be contiguous in its last dimension, got strides {t.stride()}",
    )
    check_device(name, t, device)


def mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    sm_scale: float,
    kv_lora_rank: int,
    causal: bool = True,
    kv_scale: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: query [T, H, R + P] over kv_cache [blocks, page, R + P] -> out [T, H, R], lse [T, H].

    Query rows of request b are query_start_loc[b]:query_start_loc[b + 1]; row i sits at position
    seq_lens[b] - q_len + i. `topk_indices` [T, K] int32 (-1 = unused) switches to sparse decode.
    Rows that see no key get output 0 and LSE -inf. `out` / `lse` may be given (preallocated,
    contiguous rows); otherwise they are allocated.
    """
    check_cache(kv_cache)
    device = kv_cache.device
    require(query.dim() == 3, lambda: f"query must be [T, H, D], got shape {tuple(query.shape)}")
    tokens, heads, width = query.shape
    require(
        width == kv_cache.shape[2], lambda: f"query width {width} != cache record width {kv_cache.shape[2]}"
    )
    require(0 < kv_lora_rank < width, lambda: f"kv_lora_rank {kv_lora_rank} must lie in (0, {width})")
    require(query.dtype in ACTIVATION_DTYPES, lambda: f"query dtype {query.dtype} must be bf16, fp16 or fp32")
    require(
        kv_cache.dtype in (query.dtype, FP8),
        lambda: f"kv_cache dtype {kv_cache.dtype} must match query {query.dtype} or be fp8",
    )
    require(
        query.stride(-1) == 1, f"query must be contiguous in its last dimension, got strides {query.stride()}"
    )
    check_device("query", query, device)
    _check_int("block_table", block_table, 2, device)
    _check_int("seq_lens", seq_lens, 1, device)
    _check_int("query_start_loc", query_start_loc, 1, device)
    num_reqs = seq_lens.numel()
    require(
        query_start_loc.numel() == num_reqs + 1,
        lambda: f"query_start_loc must be [{num_reqs + 1}], got {query_start_loc.numel()}",
    )
    require(
        block_table.shape[0] == num_reqs,
        lambda: f"block_table has {block_table.shape[0]} rows for {num_reqs} requests",
    )
    page = kv_cache.shape[1]
    require(
        max_seq_len <= block_table.shape[1] * page,
        lambda: f"max_seq_len {max_seq_len} exceeds the block table's {block_table.shape[1]} x {page} slots",
    )
    scale = check_scale(kv_cache, kv_scale)
    sparse = topk_indices is not None
    if sparse:
        _check_int("topk_indices", topk_indices, 2, device)
        require(
            topk_indices.shape[0] == tokens,
            lambda: f"topk_indices has {topk_indices.shape[0]} rows for {tokens} query tokens",
        )

    if out is None:
        out = torch.empty(tokens, heads, kv_lora_rank, dtype=query.dtype, device=device)
    if lse is None:
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=device)
    want = (tokens, heads, kv_lora_rank)
    require(
        tuple(out.shape) == want and out.dtype == query.dtype,
        lambda: f"out must be {query.dtype} {list(want)}, got {out.dtype} {list(out.shape)}",
    )
    require(
        tuple(lse.shape) == want[:2] and lse.dtype == torch.float32,
        lambda: f"lse must be float32 {list(want[:2])}, got {lse.dtype} {list(lse.shape)}",
    )
    require(
        out.stride(-1) == 1 and lse.stride(-1) == 1, "out and lse must be contiguous in their last dimension"
    )
    check_device("out", out, device)
    check_device("lse", lse, device)
    if tokens == 0:
        return out, lse
    groups = tokens if sparse else num_reqs
    rows_per_group = heads if sparse else max_query_len * heads
    cfg = config or default_config(rows_per_group, device.type == "cuda", kv_cache.dtype, sparse)
    require(
        not cfg.swap or cfg.num_stages >= 2,
        # H200, Triton 3.6: the unpipelined swapped loop wrote NaN and faulted (PERF_NOTES.md, round 3)
        lambda: f"swapped products need num_stages >= 2, got {cfg.num_stages}",
    )
    kernel = _stage1_kernel(cfg, sparse, query, kv_cache, rows_per_group, kv_lora_rank)
    few_rows = kernel in ("gluon_few", "gluon_fp8")
    row_blocks = 1 if few_rows else triton.cdiv(rows_per_group, cfg.block_m)
    max_keys = topk_indices.shape[1] if sparse else max_seq_len
    splits = num_splits or plan_splits(
        groups * row_blocks,
        max_keys,
        decode_gluon_few.TILE_KEYS if few_rows else cfg.block_n,
        _num_sms(device),
        1 if few_rows else cfg.ctas_per_sm,
    )
    if splits == 1:
        part_out, part_lse = out, lse
        stride_os = stride_ls = 0
    else:
        part_out = torch.empty(tokens, heads, splits, kv_lora_rank, dtype=torch.float32, device=device)
        part_lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=device)
        stride_os, stride_ls = part_out.stride(2), part_lse.stride(2)
    partials = (part_out, part_lse, stride_os, stride_ls)
    if kernel == "gluon_fp8":
        decode_gluon_fp8.launch_register_operands(
            query,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            *partials,
            scale,
            sm_scale * LOG2E,
            rows_per_group,
            splits,
            causal,
            kv_lora_rank,
        )
    elif kernel == "gluon_few":
        decode_gluon_few.launch_few_rows(
            query,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            *partials,
            sm_scale * LOG2E,
            rows_per_group,
            splits,
            causal,
            kv_lora_rank,
        )
    elif kernel == "gluon_many":
        decode_gluon_many.launch_many_rows(
            query,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            *partials,
            sm_scale_log2=sm_scale * LOG2E,
            kv_lora_rank=kv_lora_rank,
            max_query_len=max_query_len,
            splits=splits,
            causal=causal,
            block_n=cfg.block_n,
            stages=cfg.num_stages,
        )
    else:
        _launch_triton_stage1(
            cfg,
            (row_blocks, groups, splits),
            query,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            topk_indices,
            *partials,
            scale,
            sm_scale,
            kv_lora_rank,
            causal,
        )
    if splits > 1:
        _launch_stage2(
            (tokens, heads),
            part_out,
            part_lse,
            out,
            lse,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            lse.stride(1),
            RANK=kv_lora_rank,
            BLOCK_R=triton.next_power_of_2(kv_lora_rank),
            num_splits=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out, lse


def _stage1_kernel(
    cfg: DecodeConfig,
    sparse: bool,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    rows_per_group: int,
    kv_lora_rank: int,
) -> Literal["gluon_few", "gluon_fp8", "gluon_many", "triton"]:
    """The kernel that serves this call: a Gluon one where asked for and fitting, else Triton's."""
    if not cfg.gluon or sparse or decode_gluon_few is None or not _on_hopper(kv_cache.device):
        return "triton"
    if decode_gluon_few.few_rows_shapes_fit(query, kv_cache, rows_per_group, kv_lora_rank):
        if kv_cache.dtype != FP8:
            return "gluon_few"
        return "triton" if decode_gluon_fp8 is None else "gluon_fp8"
    if decode_gluon_many.many_rows_shapes_fit(query, kv_cache, kv_lora_rank, cfg.block_n, cfg.num_stages):
        return "gluon_many"
    return "triton"


@functools.cache
def _on_hopper(device: torch.device) -> bool:
    """A CUDA (not ROCm: it reports gfx9 parts as major 9 too) device of compute capability 9.x."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] == 9
    )


def _launch_triton_stage1(
    cfg: DecodeConfig,
    grid: tuple[int, int, int],
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    topk_indices: torch.Tensor | None,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    stride_os: int,
    stride_ls: int,
    scale: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    causal: bool,
) -> None:
    """The tl kernel (decode_kernels.py): every GPU, the CPU interpreter, sparse decode, fp32."""
    sparse = topk_indices is not None
    _, heads, width = query.shape
    page, rope = kv_cache.shape[1], width - kv_lora_rank
    if sparse:
        counts = query_start_loc[1:] - query_start_loc[:-1]
        token_req = torch.repeat_interleave(
            torch.arange(seq_lens.numel(), device=query.device, dtype=torch.int32),
            counts,
            output_size=query.shape[0],
        )
    else:
        token_req = seq_lens  # unused by the dense kernel
    use_tma = (
        cfg.tma
        and not sparse
        and page % cfg.block_n == 0
        and triton.next_power_of_2(kv_lora_rank) == kv_lora_rank
        and triton.next_power_of_2(rope) == rope
        and rope >= 16  # the TMA tile's rope product is a tl.dot: K >= 16 (narrower ropes gather, padded)
    )
    kv_desc = pe_desc = None
    if use_tma:
        rows_2d, row_stride = kv_cache.shape[0] * page, kv_cache.stride(1)
        kv_desc = TensorDescriptor(kv_cache, [rows_2d, width], [row_stride, 1], [cfg.block_n, kv_lora_rank])
        pe_desc = TensorDescriptor(kv_cache, [rows_2d, width], [row_stride, 1], [cfg.block_n, rope])
    _launch_stage1(
        grid,
        query,
        kv_cache,
        kv_desc,
        pe_desc,
        block_table,
        seq_lens,
        query_start_loc,
        token_req,
        topk_indices if sparse else seq_lens,
        part_out,
        part_lse,
        scale,
        sm_scale * LOG2E,
        heads,
        topk_indices.shape[1] if sparse else 0,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        topk_indices.stride(0) if sparse else 0,
        part_out.stride(0),
        part_out.stride(1),
        stride_os,
        part_lse.stride(0),
        part_lse.stride(1),
        stride_ls,
        RANK=kv_lora_rank,
        ROPE=rope,
        # tl.dot needs K >= 16: narrower latents or ropes are padded (masked loads give zeros)
        BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PAGE=page,
        num_splits=grid[2],
        SPARSE=sparse,
        CAUSAL=causal and not sparse,
        FP8=kv_cache.dtype == FP8,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32 stays fp32; 16-bit ignores it
        PREFETCH=cfg.prefetch,
        TMA=use_tma,
        SWAP=cfg.swap,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
