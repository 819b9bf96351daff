"""Standard attention (GQA) on the CPU: cpu_amx vs torch_ref, against the host memory copy
bandwidth of this run.

One layer, B requests of S tokens in a paged cache (scattered blocks of 64):
- decode: one new token per request over S cached tokens. Effective bandwidth is the K/V bytes a
  decode must read (2 * B * S * H_kv * D * element size) over the step time; the ceiling is the
  copy bandwidth (a large tensor copy, read + write, measured in this run). Caches are evicted
  before each timed step (a model's layers take turns, so a layer's KV comes from memory).
- prefill: B fresh prompts of S tokens, causal. Reported as tokens/s and the attention's useful
  GFLOP/s (causal: half of 4 * S^2 * H * D per request).
Shapes: 9/3 heads D 64 (SmolLM2-135M) and 32/8 D 128 (Llama-3-8B-like). cpu_amx's plan is built
once per step and shared by every layer; its build time is shown apart ("plan ms").

    .venv/bin/python benchmarks/bench_cpu_attn.py [--dtype bfloat16] [--append benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata
from jackfield_cpu_amx.backend import CpuAmxBackend, CpuAmxMHAImpl, compute_dtype
from jackfield_cpu_amx.capabilities import detected_amx_status

SHAPES = {"9/3 D64": (9, 3, 64), "32/8 D128": (32, 8, 128)}
BLOCK_SIZE = 64


def timed(fn: Callable[[], object], iters: int, before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of `iters` calls after one warm-up call, sorted; `before` runs untimed before each."""
    fn()
    samples = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)


def copy_bandwidth(nbytes: int = 1 << 29) -> float:
    """Host memory bandwidth in bytes/s: a tensor copy larger than the last-level cache, counting
    the read and the write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src), 5))


def cache_evictor() -> Callable[[], object]:
    """Writes a buffer twice the last-level cache (512 MiB when its size is unknown)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()
        llc = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}[size[-1]]
    except (OSError, ValueError, KeyError, IndexError):
        llc = 1 << 28
    buf = torch.empty(2 * llc // 4, dtype=torch.float32)
    return lambda: buf.fill_(1.0)


def problem(
    heads: int, kv_heads: int, head_size: int, batch: int, seq: int, q_len: int, dtype: torch.dtype
) -> tuple[AttentionLayerSpec, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """B requests of `seq` tokens, the last `q_len` of them new, in scattered blocks."""
    layer = AttentionLayerSpec(
        num_heads=heads, head_size=head_size, scale=head_size**-0.5, num_kv_heads=kv_heads
    )
    blocks = -(-seq // BLOCK_SIZE)
    num_blocks = batch * blocks + 4
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_size).to(dtype)
    table = torch.randperm(num_blocks)[: batch * blocks].view(batch, blocks).int()
    query = torch.randn(batch * q_len, heads, head_size).to(dtype)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32)
    decode = q_len == 1
    metadata = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64),  # attend writes nothing
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=q_len,
        max_seq_len=seq,
        num_decodes=batch if decode else 0,
        num_decode_tokens=batch if decode else 0,
    )
    return layer, query, kv_cache, metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048])
    parser.add_argument(
        "--prefill-tokens", type=int, default=4096,
        help="prefill only where B * S is at most this (torch_ref's per-request prefill is slow)",
    )
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: torch's). On a shared machine one thread can beat two: a parallel "
        "region waits for its slowest thread, and a thread the OS parked waits a scheduler slice",
    )
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--ref-iters", type=int, default=2, help="torch_ref's decode runs (prefill: 1)")
    parser.add_argument("--append", default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    status = detected_amx_status()
    load_before = os.getloadavg()[0]
    bandwidth = copy_bandwidth()
    evict = cache_evictor()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    rows = [
        "| shape | phase | B | S | torch_ref ms | cpu_amx ms | best ms | plan ms | x torch_ref "
        "| cpu_amx | % of copy BW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes:
        heads, kv_heads, head_size = SHAPES[shape]
        for phase in ("decode", "prefill"):
            for batch in args.batches:
                for seq in args.seqs:
                    if phase == "prefill" and batch * seq > args.prefill_tokens:
                        continue
                    q_len = 1 if phase == "decode" else seq
                    layer, query, kv_cache, md = problem(heads, kv_heads, head_size, batch, seq, q_len, dtype)
                    before = evict if phase == "decode" else None
                    ref = TorchRefBackend.make_impl(layer)
                    ref_iters = args.ref_iters if phase == "decode" else 1
                    ref_runs = timed(partial(ref.attend, query, kv_cache, md), ref_iters, before)
                    ref_s = statistics.median(ref_runs)
                    builder = CpuAmxBackend.metadata_builder()
                    plan_s = statistics.median(timed(partial(builder.build, md), args.iters))
                    built = builder.build(md)
                    impl = CpuAmxMHAImpl(layer)
                    amx_runs = timed(partial(impl.attend, query, kv_cache, built), args.iters, before)
                    amx_s, best_s = statistics.median(amx_runs), amx_runs[0]
                    if phase == "decode":
                        kv_bytes = 2 * batch * seq * kv_heads * head_size * kv_cache.element_size()
                        speed = f"{kv_bytes / amx_s / 1e9:.1f} GB/s"
                        share = f"{100 * kv_bytes / amx_s / bandwidth:.0f}%"
                    else:
                        flops = batch * 2 * seq * seq * heads * head_size  # causal half of 4 S^2 H D
                        speed, share = f"{flops / amx_s / 1e9:.0f} GFLOP/s", "-"
                    rows.append(
                        f"| {shape} | {phase} | {batch} | {seq} | {ref_s * 1e3:.2f} | {amx_s * 1e3:.2f} | "
                        f"{best_s * 1e3:.2f} | {plan_s * 1e3:.2f} | {ref_s / amx_s:.1f} | {speed} | {share} |"
                    )
                    print(rows[-1], flush=True)
    header = (
        f"CPU: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; cpu_amx path "
        f"{status.path}, {args.dtype} (products in {compute_dtype(status.path, dtype)}); host copy "
        f"bandwidth (read+write) {bandwidth / 1e9:.1f} GB/s; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; block size {BLOCK_SIZE}"
    )
    print(header)
    if args.append:
        with open(args.append, "a") as f:
            f.write(
                f"\n### cpu_amx MHA, {args.dtype}, {datetime.date.today()}\n\n{header}\n\n"
                f"Command: `python benchmarks/bench_cpu_attn.py --dtype {args.dtype}"
                + (f" --threads {args.threads}" if args.threads is not None else "") + "`\n\n"
                + "\n".join(rows) + "\n"
            )


if __name__ == "__main__":
    main()
