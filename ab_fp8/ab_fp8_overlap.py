"""One-process A/B on the H200: the fp8 few-rows kernel of main (96f56ea, serial per-tile chain)
against this branch's (PV(t-1) and QK(t) back to back), plus the bf16 kernel, same batch and cache.

Why one process: the few-rows kernels' times moved between processes (PERF_NOTES.md, round 4
lead's runs), never within one, so only an interleaved A/B in one process compares them.

Run (device, from the worktree root, after the editable install):
    python ab_fp8/ab_fp8_overlap.py [--batch 128] [--seq 4096] [--q-len 1] [--rounds 5]
Prints per kernel the median time over rounds (each round: 20 launches, CUDA events), and the
largest output difference of the branch's fp8 kernel against main's: expect 0 (the same operations
per tile, only issued earlier); a NaN, or a difference not explained, voids the timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import math
import statistics
from pathlib import Path

import torch
from jackfield_cuda_mla.kernels import decode_gluon_few as branch

RANK, ROPE, PAGE, HEADS = 512, 64, 64, 16
FP8 = torch.float8_e4m3fn


def load_baseline():
    # main's kernel file, as merged before this branch: `git show 96f56ea:plugins/cuda_mla/src/
    # jackfield_cuda_mla/kernels/decode_gluon_few.py > ab_fp8/baseline_decode_gluon_few.py`
    path = Path(__file__).with_name("baseline_decode_gluon_few.py")
    if not path.exists():
        subprocess.run(
            ["git", "show", "96f56ea:plugins/cuda_mla/src/jackfield_cuda_mla/kernels/decode_gluon_few.py"],
            stdout=path.open("w"), check=True,
        )
    spec = importlib.util.spec_from_file_location("baseline_decode_gluon_few", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(b: int, seq: int, q_len: int) -> dict:
    pages = math.ceil(seq / PAGE)
    cache = torch.randn(b * pages, PAGE, RANK + ROPE, device="cuda")
    table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    query = torch.randn(b * q_len, HEADS, RANK + ROPE, device="cuda").bfloat16()
    return dict(
        query=query,
        bf16=cache.bfloat16(),
        fp8=(cache / 0.03).clamp(-448, 448).to(FP8),
        kv_scale=torch.tensor([0.03], device="cuda"),
        table=table,
        seq_lens=torch.full((b,), seq, dtype=torch.int32, device="cuda"),
        starts=torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device="cuda"),
        q_len=q_len,
    )


def launcher(module, data: dict, cache_key: str):
    tokens = data["query"].shape[0]
    out = torch.full((tokens, HEADS, RANK), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((tokens, HEADS), float("nan"), device="cuda")

    def launch() -> None:
        module.launch_few_rows(
            data["query"],
            data[cache_key],
            data["table"],
            data["seq_lens"],
            data["starts"],
            out,
            lse,
            0,
            0,
            data["kv_scale"],
            (RANK + ROPE) ** -0.5 * 1.4426950408889634,
            data["q_len"] * HEADS,
            1,
            True,
            RANK,
        )

    return launch, out, lse


def time_us(launch, n: int = 20) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(n):
        launch()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1000 / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    baseline = load_baseline()
    data = batch(args.batch, args.seq, args.q_len)
    kernels = {
        "fp8 main (serial chain)": launcher(baseline, data, "fp8"),
        "fp8 branch (PV(t-1)+QK(t) overlap)": launcher(branch, data, "fp8"),
        "bf16 (branch = main)": launcher(branch, data, "bf16"),
    }
    for launch, _, _ in kernels.values():  # compile and warm up
        launch()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.rounds):
        for name, (launch, _, _) in kernels.items():
            times[name].append(time_us(launch))
    kv_bytes = args.batch * args.seq * (RANK + ROPE)
    print(f"B{args.batch} H{HEADS} S{args.seq} q{args.q_len}, {args.rounds} rounds x 20 launches")
    for name, ts in times.items():
        each = " / ".join(f"{t:.1f}" for t in ts)
        per_byte = kv_bytes * (2 if "bf16" in name else 1) / statistics.median(ts) / 1e3
        print(f"{name}: median {statistics.median(ts):.1f} us ({per_byte:.0f} GB/s of KV) [{each}]")
    _, out_a, lse_a = kernels["fp8 main (serial chain)"]
    _, out_b, lse_b = kernels["fp8 branch (PV(t-1)+QK(t) overlap)"]
    print("NaN in branch output:", bool(out_b.isnan().any() or lse_b.isnan().any()))
    print("max |out branch - out main|:", (out_b.float() - out_a.float()).abs().max().item())
    print("max |lse branch - lse main|:", (lse_b - lse_a).abs().max().item())


if __name__ == "__main__":
    main()
