"""Where cpu_amx's MLA decode step goes on an AMX host, and what the candidate products cost.

Times, interleaved over rounds (medians), at B=16, S=4096, H=16 (bf16 cache, gathered once):
the flash kernel as attend_group_fused calls it, with the query padded to 32 / 64 rows, in
float32 with oneDNN's bf16 math mode; bf16 bmm in both operand orders; float32 bmm under the
bf16 math mode; the softmax pieces; the gather. Then a profile of whole attend() steps, and
MKL's and oneDNN's verbose logs (which implementation and ISA each product ran on). Also the
flash kernel run over the cache's blocks where they lie (no gather), merged by LSE.

    PYTHONPATH=core/src:plugins/cpu_amx/src:benchmarks \
        python3 plugins/cpu_amx/scripts/amx_probe.py [--no-verbose]
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from bench_cpu_mla import decode_problem
from jackfield_cpu_amx.backend import CpuAmxMLAImpl
from jackfield_cpu_amx.kernels import gather_group_cache
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder, plan_key

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def bf32(on: bool) -> None:
    """oneDNN's float32 products with bf16 inputs rounded inside (AMX), or plain float32."""
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if on else "ieee"


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, reps: int, before: Callable[[], object] | None = None
) -> dict[str, float]:
    """Median ms per call of each variant; the variants take turns, `reps` calls a turn, each
    call after `before()` (untimed: e.g. evicting the cache) when given."""
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            for _ in range(reps):
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main() -> None:
    batch, heads, seq, width = 16, 16, int(os.environ.get("PROBE_SEQ", 4096)), 576
    layer, query, kv_cache, metadata = decode_problem(batch, heads, seq, 64)
    built = CpuAmxMetadataBuilder().build(metadata)
    plan = built.extra[PLANS_KEY][plan_key(built)]
    group = plan.groups[0]
    chunks = group.key_chunks(kv_cache.shape[1], split=True)
    scratch = built.extra["cpu_amx_scratch"]
    keys = gather_group_cache(kv_cache, group, chunks, torch.bfloat16, scratch).clone()  # [B, S', 576]
    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {threads} threads, chunks {chunks.num_chunks}, keys {tuple(keys.shape)}"
    )
    scale = layer.scale
    q = query.view(batch, 1, heads, width)
    k = keys.view(batch, 1, -1, width)
    q32, q64 = (torch.cat([q, torch.randn(batch, 1, r - heads, width).bfloat16()], 2) for r in (32, 64))
    kf, qf = k.float(), q.float()
    keys_f = keys.float()
    p = torch.softmax(torch.randn(batch, heads, keys.shape[1]), -1)
    p_bf = p.bfloat16()
    p_t = p_bf.transpose(1, 2).contiguous()
    s_km = torch.randn(batch, keys.shape[1], heads)

    def flash_bf32() -> object:
        bf32(True)
        try:
            return FLASH(qf, kf, kf, 0.0, False, scale=scale)
        finally:
            bf32(False)

    def bmm_km_bf32() -> object:
        bf32(True)
        try:
            return torch.bmm(keys_f, qf.view(batch, heads, width).transpose(1, 2))
        finally:
            bf32(False)

    # The flash kernel over the cache's blocks where they lie (each block a batch entry, its
    # request's queries gathered beside it), then the blocks' partial results merged by LSE.
    block_ids = metadata.block_table.flatten().long()
    owner = torch.zeros(kv_cache.shape[0], dtype=torch.long)
    owner[block_ids] = torch.arange(batch).repeat_interleave(metadata.block_table.shape[1])
    cache_blocks = kv_cache.unsqueeze(1)  # [num_blocks, 1, block_size, 576], a view

    def flash_in_place() -> torch.Tensor:
        q_blocks = query.index_select(0, owner).unsqueeze(1)
        out, lse = FLASH(q_blocks, cache_blocks, cache_blocks, 0.0, False, scale=scale)
        lse = lse.view(-1, heads).index_select(0, block_ids).view(batch, -1, heads)
        parts = out.view(-1, heads, width).index_select(0, block_ids).view(batch, -1, heads, width)
        return torch.einsum("bnh,bnhd->bhd", torch.softmax(lse, 1), parts.float())

    variants: dict[str, Callable[[], object]] = {
        "flash over cache blocks in place + merge": flash_in_place,
        "gather (int64 index_select)": lambda: gather_group_cache(
            kv_cache, group, chunks, torch.bfloat16, scratch
        ),
        "flash bf16, 16 rows": lambda: FLASH(q, k, k, 0.0, False, scale=scale),
        "flash bf16, 32 rows": lambda: FLASH(q32, k, k, 0.0, False, scale=scale),
        "flash bf16, 64 rows": lambda: FLASH(q64, k, k, 0.0, False, scale=scale),
        "flash f32 keys, bf32 math": flash_bf32,
        "bmm bf16 q@k^T [B,16,S]": lambda: torch.bmm(q.view(batch, heads, width), keys.transpose(1, 2)),
        "bmm bf16 k@q^T [B,S,16]": lambda: torch.bmm(keys, q.view(batch, heads, width).transpose(1, 2)),
        "bmm f32 k@q^T, bf32 math": bmm_km_bf32,
        "bmm bf16 p@v [B,16,576]": lambda: torch.bmm(p_bf, keys),
        "bmm bf16 v^T@p^T [B,576,16]": lambda: torch.bmm(keys.transpose(1, 2), p_t),
        "softmax pieces [B,S,16] f32": lambda: torch.exp(s_km - s_km.amax(1, keepdim=True)).sum(1),
        "keys bf16->f32 copy": lambda: keys_f.copy_(keys),
    }
    times = interleaved(variants, rounds=5, reps=4)
    flops_qk = 2 * batch * heads * keys.shape[1] * width
    print("| what | ms | GFLOP/s per core (16 rows) |\n|---|---|---|")
    for name, ms in times.items():
        flops = 2 * flops_qk if name.startswith("flash") else flops_qk if name.startswith("bmm") else 0
        rate = f"{flops / ms / 1e6 / threads:.0f}" if flops else ""
        print(f"| {name} | {ms:.3f} | {rate} |", flush=True)

    impl = CpuAmxMLAImpl(layer, path="amx_bf16")
    step = lambda: impl.attend(query, kv_cache, built, return_lse=True)  # noqa: E731
    print(f"attend step: {interleaved({'step': step}, rounds=5, reps=4)['step']:.3f} ms")
    with torch.profiler.profile() as prof:
        for _ in range(10):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))

    if "--no-verbose" not in sys.argv and os.environ.get("ONEDNN_VERBOSE") is None:
        # One more process with oneDNN's and MKL's verbose logs, summarized.
        env = {**os.environ, "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
        argv = [sys.executable, __file__, "--verbose-only"]
        log = subprocess.run(argv, env=env, capture_output=True, text=True).stdout
        summary: dict[str, list[str]] = collections.defaultdict(list)
        for line in log.splitlines():
            f = line.split(",")
            if len(f) > 8 and f[0] == "onednn_verbose" and "exec" in f:
                i = f.index("exec")
                summary[f"oneDNN {f[i + 2]} | {f[i + 3]} | {f[-2]}"].append(f[-1])
            elif line.startswith("MKL_VERBOSE") and "(" in line:
                call, args = line.split()[1].split("(", 1)
                summary[f"MKL {call}({','.join(args.split(',')[:5])}"].append(line.split(")")[1].split()[0])
            elif line.startswith(("MKL_VERBOSE", "onednn_verbose,v1,info,cpu")):
                print("  " + line[:300])
        print("verbose exec lines (what | implementation | problem: count, times):")
        for key, times in list(summary.items())[:20]:
            print(f"  {key}: {len(times)}, {' '.join(times[:4])}")


def verbose_only() -> None:
    """One call of each product at a small size, for oneDNN's verbose log."""
    batch, heads, width = 4, 16, 576
    keys = torch.randn(batch, 1024, width).bfloat16()
    q = torch.randn(batch, 1, heads, width).bfloat16()
    FLASH(q, keys.unsqueeze(1), keys.unsqueeze(1), 0.0, False, scale=0.1)
    torch.bmm(keys, q.view(batch, heads, width).transpose(1, 2))
    torch.bmm(q.view(batch, heads, width), keys.transpose(1, 2))
    bf32(True)
    torch.bmm(keys.float(), q.float().view(batch, heads, width).transpose(1, 2))
    FLASH(q.float(), keys.unsqueeze(1).float(), keys.unsqueeze(1).float(), 0.0, False, scale=0.1)


if __name__ == "__main__":
    verbose_only() if "--verbose-only" in sys.argv else main()
