"""Benchmark: the murmur3 Gumbel-max sampler (Triton) on batch 256 x vocab 129,280 float32 logits.

Ceiling from the same run: the time to read the logits once at the measured device copy bandwidth.
Baselines from the same process: torch.multinomial(softmax(logits)) and the PyTorch reference
(impl="torch"). Also a sweep of Triton block shapes (tokens must not change) and top-k 50 / top-p 0.9.

    PYTHONPATH=core/src python3 benchmarks/bench_sampler.py
"""

from __future__ import annotations

import torch
import triton
from jackfield.sampling import sample
from jackfield.sampling.gumbel_triton import gumbel_argmax_triton

ROWS, VOCAB = 256, 129_280


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write bytes)."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def main() -> None:
    torch.manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, device="cuda") * 4
    temperature = torch.rand(ROWS, device="cuda") + 0.5
    seeds = torch.randint(0, 2**62, (ROWS,), device="cuda")
    positions = torch.randint(0, 2**20, (ROWS,), device="cuda")
    top_k = torch.full((ROWS,), 50, device="cuda")
    top_p = torch.full((ROWS,), 0.9, device="cuda")
    args = (logits, temperature, seeds, positions)

    bandwidth = copy_bandwidth()
    read_once_ms = logits.numel() * 4 / bandwidth * 1e3
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"read logits once at that bandwidth: {read_once_ms * 1e3:.1f} us")

    want = gumbel_argmax_triton(*args, None)
    sweep = []
    for block, per_chunk, warps in [
        (1024, 8, 4),
        (512, 16, 4),
        (2048, 4, 8),
        (1024, 4, 4),
        (1024, 16, 8),
        (4096, 2, 8),
    ]:
        got = gumbel_argmax_triton(*args, None, block=block, blocks_per_chunk=per_chunk, num_warps=warps)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (block, per_chunk, warps)
        ms = bench_ms(lambda b=block, c=per_chunk, w=warps: gumbel_argmax_triton(*args, None, b, c, w))
        sweep.append((ms, block, per_chunk, warps))
    print("triton kernel sweep (block, blocks/chunk, warps): median ms")
    for ms, block, per_chunk, warps in sorted(sweep):
        print(
            f"  ({block:5d}, {per_chunk:2d}, {warps}) {ms * 1e3:8.1f} us  {ms / read_once_ms:5.2f}x read-once"
        )

    def multinomial() -> torch.Tensor:
        return torch.multinomial(torch.softmax(logits / temperature[:, None], dim=-1), 1)

    rows = [
        ("triton sample(), temperature only", bench_ms(lambda: sample(*args, impl="triton"))),
        ("torch reference sample(impl='torch')", bench_ms(lambda: sample(*args, impl="torch"))),
        ("torch.multinomial(softmax(logits / T))", bench_ms(multinomial)),
        (
            "triton sample(), top-k 50 / top-p 0.9",
            bench_ms(lambda: sample(*args, top_k, top_p, impl="triton")),
        ),
        (
            "torch reference, top-k 50 / top-p 0.9",
            bench_ms(lambda: sample(*args, top_k, top_p, impl="torch")),
        ),
    ]
    plain = rows[0][1]
    print(f"\n| {'what':42s} | time (us) | x read-once | x triton |")
    print(f"|{'-' * 44}|-----------|-------------|----------|")
    for name, ms in rows:
        print(f"| {name:42s} | {ms * 1e3:9.1f} | {ms / read_once_ms:11.2f} | {ms / plain:8.2f} |")


if __name__ == "__main__":
    main()
