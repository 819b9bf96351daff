"""MLA decode on the CPU: cpu_amx vs torch_ref, against the host memory copy bandwidth of this run.

One decode step of one layer: B requests, one new token each, S cached tokens, H heads,
kv_lora_rank 512 + rope 64 latent records in a bfloat16 paged cache. Effective bandwidth is the
cache bytes a decode must read (B * S * 576 * 2) over the step time.

On an AMX host cpu_amx decodes with its native kernel (reads the paged cache in place); the
PyTorch path (gather + flash kernel) is timed in the same run for the A/B (--decode-kernels).

    .venv/bin/python benchmarks/bench_cpu_mla.py [--heads 16 128] [--append benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata
from jackfield_cpu_amx.backend import CpuAmxMLAImpl, compute_dtype
from jackfield_cpu_amx.capabilities import ComputePath, detected_amx_status
from jackfield_cpu_amx.kernels import attend_group_bmm, attend_group_fused, gather_group_cache
from jackfield_cpu_amx.native import NativeKernel, decode_kernel_name, native_decode_kernel
from jackfield_cpu_amx.plan import (
    DEFAULT_GROUP_KEYS,
    FUSED_MAX_ROWS,
    PLANS_KEY,
    CpuAmxMetadataBuilder,
    plan_key,
)

KV_LORA_RANK, ROPE = 512, 64


def timed(fn: Callable[[], object], iters: int, before: Callable[[], object] | None = None) -> float:
    """Median seconds of `iters` calls after one warm-up call; `before` runs untimed before each."""
    fn()
    samples = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Host memory bandwidth in bytes/s: a large tensor copy, counting the read and the write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), 5)


def cache_evictor() -> Callable[[], object]:
    """Writes a buffer twice the last-level cache (1 GiB when its size is unknown), so that the KV
    cache of the next call comes from memory, as it does when a model's layers take turns: one
    layer's cache at B=16, S=4096 (75 MB) fits the AMX host's 300 MiB L3."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()
        llc = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}[size[-1]]
    except (OSError, ValueError, KeyError, IndexError):
        llc = 1 << 29
    buf = torch.empty(2 * llc // 4, dtype=torch.float32)
    return lambda: buf.fill_(1.0)


def decode_problem(
    batch: int, heads: int, seq: int, block_size: int
) -> tuple[AttentionLayerSpec, torch.Tensor, torch.Tensor, AttentionMetadata]:
    layer = AttentionLayerSpec(
        num_heads=heads,
        head_size=KV_LORA_RANK + ROPE,
        scale=192**-0.5,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=128,
        qk_rope_head_dim=ROPE,
        v_head_dim=128,
    )
    blocks = seq // block_size
    num_blocks = batch * blocks + 16
    kv_cache = torch.randn(num_blocks, block_size, KV_LORA_RANK + ROPE).to(torch.bfloat16)
    table = torch.randperm(num_blocks)[: batch * blocks].view(batch, blocks).int()  # scattered blocks
    query = torch.randn(batch, heads, KV_LORA_RANK + ROPE).to(torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=(table[:, -1].long() * block_size + block_size - 1),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=seq,
        num_decodes=batch,
        num_decode_tokens=batch,
    )
    return layer, query, kv_cache, metadata


def breakdown(
    layer: AttentionLayerSpec,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    built: AttentionMetadata,
    path: ComputePath,
    iters: int,
) -> str:
    """ms per step spent gathering and in the attention kernel, summed over the step's groups."""
    plan = built.extra[PLANS_KEY][plan_key(built)]
    scratch = built.extra["cpu_amx_scratch"]
    dtype = compute_dtype(path, query.dtype)
    q = query.to(dtype)
    gather_s = kernel_s = 0.0
    for group in plan.groups:
        fused = plan.fused(group, layer.num_heads, dtype)
        chunks = group.key_chunks(kv_cache.shape[1], split=fused)
        keys = gather_group_cache(kv_cache, group, chunks, dtype, scratch).clone()
        t0, t1 = group.token_start, group.token_start + group.num_reqs * group.q_len
        out = torch.empty(t1 - t0, layer.num_heads, KV_LORA_RANK, dtype=query.dtype)
        lse = torch.empty(t1 - t0, layer.num_heads)
        attend = attend_group_fused if fused else attend_group_bmm
        gather_s += timed(partial(gather_group_cache, kv_cache, group, chunks, dtype, scratch), iters)
        kernel_s += timed(
            partial(attend, q[t0:t1], keys, group, chunks, KV_LORA_RANK, layer.scale, out, lse), iters
        )
    return f"gather {gather_s * 1e3:.2f} ms + kernel {kernel_s * 1e3:.2f} ms over {len(plan.groups)} groups"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--group-keys", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--chunk-keys", type=int, nargs="+", default=[0], help="0: by thread count")
    parser.add_argument(
        "--fused-max-rows",
        type=int,
        nargs="+",
        default=[FUSED_MAX_ROWS],
        help="query rows per request up to which the fused kernel runs (0: always the bmm kernel)",
    )
    parser.add_argument("--breakdown", action="store_true", help="also time gather and kernel apart")
    parser.add_argument(
        "--evict",
        action="store_true",
        help="evict the caches before each timed step (cache read from memory)",
    )
    parser.add_argument("--paths", nargs="+", default=None, help="compute paths (default: the detected one)")
    parser.add_argument(
        "--decode-kernels",
        nargs="+",
        choices=["native", "flash"],
        default=None,
        help="native: the AMX kernel (one row per H and path, default group keys); flash: the "
        "PyTorch path, one row per setting (default: both when the native kernel is active)",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ref-iters", type=int, default=2)
    parser.add_argument("--append", default=None, help="append the table to this markdown file")
    args = parser.parse_args()

    status = detected_amx_status()
    paths: list[ComputePath] = args.paths or [status.path]
    native = native_decode_kernel()
    decode_kernels = args.decode_kernels or (
        ["native", "flash"] if isinstance(native, NativeKernel) else ["flash"]
    )
    if "native" in decode_kernels and not isinstance(native, NativeKernel):
        parser.error(f"no native kernel here: {native}")
    bandwidth = copy_bandwidth()
    before = cache_evictor() if args.evict else None
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    header = (
        f"CPU: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; detected path: "
        f"{status.path} ({status.reason}); decode kernel: {decode_kernel_name(native)}\n"
        f"host copy bandwidth (read+write): {bandwidth / 1e9:.1f} GB/s; "
        f"B={args.batch}, S={args.seq}, block {args.block_size}, "
        f"kv_lora_rank {KV_LORA_RANK} + rope {ROPE}, bf16 cache"
        + ("; caches evicted before each step" if args.evict else "")
    )
    rows = [
        "| H | backend | kernel | group keys | chunk keys | step ms | tokens/s | eff. GB/s "
        "| % of copy BW | x torch_ref |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print(header)
    for heads in args.heads:
        layer, query, kv_cache, metadata = decode_problem(args.batch, heads, args.seq, args.block_size)

        def row(name: str, keys: str, seconds: float, ref_seconds: float, heads: int = heads) -> str:
            eff = args.batch * args.seq * (KV_LORA_RANK + ROPE) * 2 / seconds  # bfloat16 records
            return (
                f"| {heads} | {name} | {keys} | {seconds * 1e3:.2f} | {args.batch / seconds:,.0f} | "
                f"{eff / 1e9:.1f} | {100 * eff / bandwidth:.0f}% | {ref_seconds / seconds:.1f} |"
            )

        ref_impl = TorchRefBackend.make_impl(layer)
        ref_s = timed(
            partial(ref_impl.attend, query, kv_cache, metadata, return_lse=True), args.ref_iters, before
        )
        rows.append(row("torch_ref", "- | - | -", ref_s, ref_s))
        print(rows[-1], flush=True)
        for path in paths if "native" in decode_kernels else []:
            impl = CpuAmxMLAImpl(layer, path=path, native_kernel=native)
            built = CpuAmxMetadataBuilder(DEFAULT_GROUP_KEYS).build(metadata)
            s = timed(partial(impl.attend, query, kv_cache, built, return_lse=True), args.iters, before)
            rows.append(row(f"cpu_amx {path}", f"native | {DEFAULT_GROUP_KEYS} | -", s, ref_s))
            print(rows[-1], flush=True)
        settings = itertools.product(paths, args.fused_max_rows, args.group_keys, args.chunk_keys)
        for path, fused_max_rows, group_keys, chunk_keys in settings if "flash" in decode_kernels else []:
            if fused_max_rows < heads and chunk_keys:
                continue  # the bmm kernel reads one chunk per request
            impl = CpuAmxMLAImpl(layer, path=path, native_kernel="the A/B's PyTorch side")
            built = CpuAmxMetadataBuilder(group_keys, chunk_keys or None, fused_max_rows).build(metadata)
            s = timed(partial(impl.attend, query, kv_cache, built, return_lse=True), args.iters, before)
            # as StepPlan.fused decides: bf16 products always run the fused (flash) kernel
            bf16 = compute_dtype(path, query.dtype) != torch.float32
            kernel = "fused" if heads <= fused_max_rows or bf16 else "bmm"
            keys = f"{kernel} | {group_keys} | {chunk_keys or 'auto'}"
            rows.append(row(f"cpu_amx {path}", keys, s, ref_s))
            print(rows[-1], flush=True)
            if args.breakdown:
                print(f"  {breakdown(layer, query, kv_cache, built, path, args.iters)}", flush=True)
    if args.append:
        flags = []  # the command as it can be re-run: store_true flags bare, absent when off
        for k, v in vars(args).items():
            if v is None or v is False or k == "append":
                continue
            name = f"--{k.replace('_', '-')}"
            flags.append(
                name if v is True else f"{name} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            )
        command = "python benchmarks/bench_cpu_mla.py " + " ".join(flags)
        with open(args.append, "a") as f:
            f.write(
                f"\n### cpu_amx MLA decode, {datetime.date.today()}\n\n{header}\n\nCommand: `{command}`\n\n"
                + "\n".join(rows)
                + "\n"
            )


if __name__ == "__main__":
    main()
