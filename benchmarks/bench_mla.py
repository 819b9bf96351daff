"""cuda_mla on one GPU: decode (dense, MTP, fp8, sparse) and KV insert vs the measured ceilings.

Run:  PYTHONPATH=core/src:plugins/cuda_mla/src python benchmarks/bench_mla.py [--sweep] [--out FILE]
Prints, per kernel and shape, for the default kernels: the GPU time (median of
triton.testing.do_bench_cudagraph: the call captured in a CUDA graph and replayed, as engines run
decode), effective bandwidth (KV read once + Q + O) against the device copy bandwidth measured
here, TFLOP/s (2 * tokens * H * S * (576 + 512)) against the bf16 matmul rate measured here, the
max error against torch_ref and torch_ref's wall time (it syncs on the host; same shapes, same
process) over the GPU time; beside them the eager
time (median of triton.testing.do_bench: includes the host's launch where the host is slower than
the GPU) and the host time a call costs (Python, checks, launch).
--sweep also times tile variants and names the fastest beside the default, never in its place.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
from gpu_timing import host_us
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata
from jackfield_cuda_mla.kernels import mla_decode, mla_kv_insert
from jackfield_cuda_mla.kernels.decode import DecodeConfig, default_config
from triton.testing import do_bench, do_bench_cudagraph

RANK, ROPE, PAGE = 512, 64, 64
WIDTH = RANK + ROPE
SCALE = WIDTH**-0.5
FP8 = torch.float8_e4m3fn
# --sweep variants per case kind: (block_n, warps, stages, splits or None = auto, prefetch, tma, swap, gluon)
# (gluon: the Gluon kernel where it applies; the few-rows one has its own tile, the many-rows one takes
# block_n keys a tile in `stages` buffers; the other fields are the Triton kernel's)
SWEEPS = {
    "h16": [
        (64, 4, 3, None, False, True, True, False),  # the Triton kernel's default (round 3)
        (64, 4, 2, None, False, True, True, False),
        (64, 4, 3, 2, False, True, True, True),
    ],
    "fp8": [
        (32, 4, 1, 2, True, False, False, False),  # the Triton kernel's default (round 3)
        (64, 4, 3, 2, False, False, False, True),
    ],
    "h128": [
        (64, 8, 2, None, False, True, False, False),  # the Triton kernel (the default before Gluon)
        (32, 8, 4, None, False, True, False, True),
        (64, 8, 2, 2, False, True, False, True),
    ],
}


def ceilings() -> tuple[float, float]:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ a)
    return 2 * (2 << 30) / copy_ms / 1e6, 2 * 8192**3 / mm_ms / 1e9  # GB/s (read + write), TFLOP/s


def make_case(
    batch: int, heads: int, seq: int, q_len: int, fp8: bool = False, topk: int = 0, sweep: str = ""
) -> dict:
    blocks_per_req = seq // PAGE
    num_blocks = batch * blocks_per_req
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).reshape(batch, blocks_per_req)
    cache = torch.randn(num_blocks, PAGE, WIDTH, device="cuda", dtype=torch.bfloat16)
    scale = None
    if fp8:
        scale = torch.tensor([0.05], device="cuda")
        cache = (cache.float() / scale).clamp(-448, 448).to(FP8)
    tokens = batch * q_len
    qsl = torch.arange(0, tokens + 1, q_len, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
    indices = None
    if topk:
        indices = torch.rand(tokens, seq, device="cuda").argsort(dim=1)[:, :topk].int().contiguous()
    query = torch.randn(tokens, heads, WIDTH, device="cuda", dtype=torch.bfloat16)
    return dict(
        query=query,
        cache=cache,
        block_table=block_table,
        seq_lens=seq_lens,
        qsl=qsl,
        q_len=q_len,
        seq=seq,
        scale=scale,
        topk=indices,
        sweep=sweep,
    )


def run_kernel(c: dict, config: DecodeConfig | None = None, splits: int | None = None):
    return mla_decode(
        c["query"],
        c["cache"],
        c["block_table"],
        c["seq_lens"],
        c["qsl"],
        max_query_len=c["q_len"],
        max_seq_len=c["seq"],
        sm_scale=SCALE,
        kv_lora_rank=RANK,
        kv_scale=c["scale"],
        topk_indices=c["topk"],
        config=config,
        num_splits=splits,
    )


def run_ref(c: dict) -> torch.Tensor:
    heads = c["query"].shape[1]
    layer = AttentionLayerSpec(
        num_heads=heads,
        head_size=WIDTH,
        scale=SCALE,
        kv_lora_rank=RANK,
        qk_nope_head_dim=128,
        qk_rope_head_dim=ROPE,
        v_head_dim=128,
        kv_cache_dtype="fp8_e4m3" if c["scale"] is not None else "auto",
    )
    md = AttentionMetadata(
        query_start_loc=c["qsl"],
        seq_lens=c["seq_lens"],
        block_table=c["block_table"],
        slot_mapping=torch.zeros(c["query"].shape[0], dtype=torch.int64, device="cuda"),
        query_start_loc_cpu=c["qsl"].cpu(),
        seq_lens_cpu=c["seq_lens"].cpu(),
        max_query_len=c["q_len"],
        max_seq_len=c["seq"],
        num_decodes=c["seq_lens"].numel(),
        num_decode_tokens=c["query"].shape[0],
    )
    impl = TorchRefBackend.make_impl(layer)
    return impl.attend(c["query"], c["cache"], md, kv_scale=c["scale"], topk_indices=c["topk"]).out


def gpu_ms(fn) -> float:
    """GPU time of one call: captured in a CUDA graph and replayed (no host time in it)."""
    # do_bench_cudagraph runs fn on a side stream that does not wait for the default stream's
    # pending work (the inputs just generated): without this sync it read half-written tensors
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, return_mode="median")


def wall_ms(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_row(name: str, c: dict, copy_gbs: float, mm_tflops: float, sweep: bool) -> str:
    tokens, heads, _ = c["query"].shape
    keys = c["topk"].shape[1] if c["topk"] is not None else c["seq"]
    kv_elems = tokens * keys if c["topk"] is not None else c["seq_lens"].numel() * keys
    kv_bytes = kv_elems * WIDTH * c["cache"].element_size()
    nbytes = kv_bytes + tokens * heads * (WIDTH + RANK) * 2
    flops = 2 * tokens * heads * keys * (WIDTH + RANK)
    default_ms = gpu_ms(lambda: run_kernel(c))
    eager_ms = do_bench(lambda: run_kernel(c), return_mode="median")
    launch_us = host_us(lambda: run_kernel(c))
    best = "-"  # the fastest sweep variant, reported beside the default, never in its place
    variants = SWEEPS.get(c.get("sweep") or "", []) if sweep else []
    if variants:
        print(f"  {name} default: {default_ms * 1e3:.1f} us", flush=True)
        rows = tokens // c["seq_lens"].numel() * heads if c["topk"] is None else heads
        block_m = default_config(rows, True).block_m
        want = run_kernel(c)[0].float()
        best_ms = float("inf")
        for bn, warps, stages, splits, prefetch, tma, swap, gluon in variants:
            cfg = DecodeConfig(block_m, bn, warps, stages, prefetch, tma, swap, gluon=gluon)
            label = f"bn{bn}/w{warps}/s{stages}/split{splits or 'auto'}{'/prefetch' if prefetch else ''}"
            label += ("/tma" if tma else "") + ("/swap" if swap else "")
            if gluon:
                tile = f" bn{bn}/s{stages}" if block_m >= 64 else ""  # the few-rows kernel's tile is fixed
                label = f"gluon{tile}/split{splits or 'auto'}"
            try:
                diff = (run_kernel(c, cfg, splits)[0].float() - want).abs().max().item()
                ms = gpu_ms(lambda cfg=cfg, splits=splits: run_kernel(c, cfg, splits))
            except Exception as exc:  # out of shared memory / registers for this tile: skip it
                print(f"  {name} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            print(f"  {name} {label}: {ms * 1e3:.1f} us (max diff vs default {diff:.1e})", flush=True)
            if ms < best_ms and diff < 0.05:
                best_ms, best = ms, f"{label}: {ms * 1e3:.1f} us"
    out = run_kernel(c)[0]
    ref_ms = wall_ms(lambda: run_ref(c), reps=2)
    err = (out.float() - run_ref(c).float()).abs().max().item()
    gbs = nbytes / default_ms / 1e6
    tflops = flops / default_ms / 1e9
    return (
        f"| {name} | {default_ms * 1e3:.1f} | {gbs:.0f} | {gbs / copy_gbs:.0%} | {tflops:.1f} | "
        f"{tflops / mm_tflops:.0%} | {err:.2e} | {ref_ms / default_ms:.0f}x | {eager_ms * 1e3:.1f} | "
        f"{launch_us:.0f} | {best} |"
    )


def insert_rows(copy_gbs: float) -> list[str]:
    """Per-layer inserts reuse one slot_mapping (range checked once); 'new slots' pays that check."""
    lines = []
    cache = torch.empty(65536 // PAGE * 2, PAGE, WIDTH, device="cuda", dtype=torch.bfloat16)
    flat = cache.view(-1, WIDTH)
    for tokens in (1, 256, 16384, 65536):
        kv_c = torch.randn(tokens, RANK, device="cuda", dtype=torch.bfloat16)
        k_pe = torch.randn(tokens, ROPE, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(flat.shape[0], device="cuda")[:tokens]
        ms = do_bench(lambda kv_c=kv_c, k_pe=k_pe, slots=slots: mla_kv_insert(kv_c, k_pe, cache, slots))
        fresh_ms = do_bench(
            lambda kv_c=kv_c, k_pe=k_pe, slots=slots: mla_kv_insert(kv_c, k_pe, cache, slots.clone())
        )
        # under capture the slot-range check (a host sync) is skipped, as in an engine's CUDA graph
        graph_ms = gpu_ms(lambda kv_c=kv_c, k_pe=k_pe, slots=slots: mla_kv_insert(kv_c, k_pe, cache, slots))
        launch_us = host_us(lambda kv_c=kv_c, k_pe=k_pe, slots=slots: mla_kv_insert(kv_c, k_pe, cache, slots))
        records = torch.cat([kv_c, k_pe], 1)
        ok = torch.equal(flat[slots], records)
        ref_ms = do_bench(lambda records=records, slots=slots: flat.index_copy_(0, slots, records))
        gbs = 2 * tokens * WIDTH * 2 / ms / 1e6
        lines.append(
            f"| insert {tokens} tokens | {ms * 1e3:.1f} | {fresh_ms * 1e3:.1f} | {gbs:.0f} | "
            f"{gbs / copy_gbs:.0%} | {graph_ms * 1e3:.1f} | {launch_us:.0f} | exact={ok} | "
            f"torch index_copy {ref_ms * 1e3:.1f} us ({ref_ms / ms:.1f}x) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default="", help="comma-separated substrings of case names to run")
    parser.add_argument("--no-insert", action="store_true", help="skip the KV insert rows")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbs, mm_tflops = ceilings()
    lines = [
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
        f"ceilings measured here: copy {copy_gbs:.0f} GB/s (read + write), "
        f"bf16 matmul {mm_tflops:.0f} TFLOP/s",
        "",
        "| case | us (GPU, default) | GB/s | of copy BW | TFLOP/s | of matmul | max err vs torch_ref "
        "| torch_ref wall / GPU | us (eager do_bench) | host us/call | fastest --sweep variant (GPU us) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    cases = [
        ("B128 H16 S4096 q1 bf16", dict(batch=128, heads=16, seq=4096, q_len=1, sweep="h16")),
        ("B128 H16 S8192 q1 bf16", dict(batch=128, heads=16, seq=8192, q_len=1, sweep="h16")),
        ("B128 H16 S4096 q2 bf16 (MTP)", dict(batch=128, heads=16, seq=4096, q_len=2, sweep="h16")),
        ("B128 H16 S4096 q1 fp8", dict(batch=128, heads=16, seq=4096, q_len=1, fp8=True, sweep="fp8")),
        ("B128 H16 S4096 q2 fp8 (MTP)", dict(batch=128, heads=16, seq=4096, q_len=2, fp8=True, sweep="fp8")),
        ("B128 H128 S4096 q1 bf16", dict(batch=128, heads=128, seq=4096, q_len=1, sweep="h128")),
        ("B128 H128 S4096 q2 bf16 (MTP)", dict(batch=128, heads=128, seq=4096, q_len=2, sweep="h128")),
        ("sparse top2048 B64 H128 q2", dict(batch=64, heads=128, seq=8192, q_len=2, topk=2048)),
        ("sparse top2048 B128 H128 q2", dict(batch=128, heads=128, seq=8192, q_len=2, topk=2048)),
    ]
    wanted = [w for w in args.only.split(",") if w]
    for name, shape in cases:
        if wanted and not any(w in name for w in wanted):
            continue
        row = decode_row(name, make_case(**shape), copy_gbs, mm_tflops, args.sweep)
        print(row, flush=True)
        lines.append(row)
        torch.cuda.empty_cache()
    if not args.no_insert:
        lines += insert_table(copy_gbs)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def insert_table(copy_gbs: float) -> list[str]:
    lines = [
        "",
        "| insert | us (slots checked) | us (new slots: clone + check) | GB/s (read + write) | of copy BW "
        "| us (GPU, graph: L2 warm) | host us/call | check | baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in insert_rows(copy_gbs):
        print(row, flush=True)
        lines.append(row)
    return lines


if __name__ == "__main__":
    main()
