"""One-process A/B on the H200 (branch fp8-regs, not for main): the register-operand fp8 kernel
(decode_gluon_fp8) against the converter kernel with two consumers (decode_gluon_few, main's fp8
default at 16 rows) and the bf16 kernel, same batch, interleaved rounds.

Run on the device after the editable install:  python ab_fp8/ab_registers.py [--seq 4096] [--rounds 5]
Prints per kernel the median over rounds of 20 back-to-back launches (CUDA events) and the
CUDA-graph time, the fp8 ratio to bf16, and the largest difference between the two fp8 kernels'
outputs (expect bf16 rounding, <= ~1e-3; a NaN or more voids the timing).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from jackfield_cuda_mla.kernels import decode_gluon_few as few
from jackfield_cuda_mla.kernels import decode_gluon_fp8 as regs
from triton.testing import do_bench_cudagraph

RANK, ROPE, PAGE, HEADS = 512, 64, 64, 16
LOG2E = 1.4426950408889634


def batch(b: int, seq: int) -> dict:
    pages = math.ceil(seq / PAGE)
    values = torch.randn(b * pages, PAGE, RANK + ROPE, device="cuda")
    return dict(
        query=torch.randn(b, HEADS, RANK + ROPE, device="cuda").bfloat16(),
        bf16=values.bfloat16(),
        fp8=(values / 0.03).clamp(-448, 448).to(torch.float8_e4m3fn),
        kv_scale=torch.tensor([0.03], device="cuda"),
        table=torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages),
        seq_lens=torch.full((b,), seq, dtype=torch.int32, device="cuda"),
        starts=torch.arange(0, b + 1, dtype=torch.int32, device="cuda"),
    )


def kernels(d: dict) -> dict:
    b = d["query"].shape[0]
    scale = (RANK + ROPE) ** -0.5 * LOG2E
    made = {}
    for name in ("fp8 registers", "fp8 converter", "bf16"):
        out = torch.full((b, HEADS, RANK), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((b, HEADS), float("nan"), device="cuda")
        common = (d["query"], d["bf16" if name == "bf16" else "fp8"], d["table"], d["seq_lens"], d["starts"])
        if name == "fp8 registers":

            def launch(common=common, out=out, lse=lse):
                regs.launch_register_operands(*common, out, lse, 0, 0, d["kv_scale"], scale, 1, True, RANK)
        else:

            def launch(common=common, out=out, lse=lse):
                few.launch_few_rows(*common, out, lse, 0, 0, d["kv_scale"], scale, HEADS, 1, True, RANK)

        made[name] = (launch, out, lse)
    return made


def events_us(launch, n: int = 20) -> float:
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
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    d = batch(args.batch, args.seq)
    made = kernels(d)
    for launch, _, _ in made.values():
        launch()
    torch.cuda.synchronize()
    times = {name: [] for name in made}
    for _ in range(args.rounds):
        for name, (launch, _, _) in made.items():
            times[name].append(events_us(launch))
    print(f"B{args.batch} H{HEADS} S{args.seq} q1, {args.rounds} rounds x 20 launches")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        torch.cuda.synchronize()
        graph = do_bench_cudagraph(made[name][0], return_mode="median") * 1e3
        each = " / ".join(f"{t:.1f}" for t in ts)
        print(
            f"{name}: median {medians[name]:.1f} us, graph {graph:.1f} us "
            f"(bf16 / this: {medians['bf16'] / medians[name]:.2f}x) [{each}]"
        )
    _, out_r, lse_r = made["fp8 registers"]
    _, out_c, lse_c = made["fp8 converter"]
    print("NaN in register kernel:", bool(out_r.isnan().any() or lse_r.isnan().any()))
    print("max |out registers - converter|:", (out_r.float() - out_c.float()).abs().max().item())
    print("max |lse registers - converter|:", (lse_r - lse_c).abs().max().item())


if __name__ == "__main__":
    main()
