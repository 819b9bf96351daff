"""The native AMX decode kernel alone on an AMX host: splits, prefetch variants, threads, with
the cache in L3 or evicted, against the host copy bandwidth of the same run.

At B=16, S=4096, block 64, kv_lora_rank 512 + rope 64 (75.5 MB of cache a step), H=16 and 128.
Variants take turns over rounds (medians). Source variants (prefetch off, prefetch a chunk
further ahead) are built from edited copies of native/mla_decode.c in a temporary cache; the
package's build is "as built". Also: whole attend() steps against the kernel call alone.

    PYTHONPATH=core/src:plugins/cpu_amx/src:benchmarks python3 plugins/cpu_amx/scripts/native_probe.py
"""

from __future__ import annotations

import collections
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from bench_cpu_mla import cache_evictor, copy_bandwidth, decode_problem
from jackfield_cpu_amx.backend import CpuAmxMLAImpl
from jackfield_cpu_amx.native import AMX_FLAGS, COMMON_FLAGS, LIBS, SOURCE, NativeKernel
from jackfield_cpu_amx.native_build import build_library
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder, plan_key

PREFETCH_CALL = "prefetch_some(&pf, prefetch_per_step);"
PREFETCH_RANGE = "key = chunk + CHUNK_KEYS; key < key_end && key < chunk + 2 * CHUNK_KEYS;"
SOURCE_EDITS = {
    "no prefetch": (PREFETCH_CALL, ""),
    "prefetch 2 ahead": (
        PREFETCH_RANGE,
        "key = chunk + 2 * CHUNK_KEYS; key < key_end && key < chunk + 3 * CHUNK_KEYS;",
    ),
}


def variant_kernel(name: str, cache: Path) -> NativeKernel:
    old, new = SOURCE_EDITS[name]
    text = SOURCE.read_text()
    assert text.count(old) == 1, name
    source = cache / f"{name.replace(' ', '_')}.c"
    source.write_text(text.replace(old, new))
    return NativeKernel(build_library(source, COMMON_FLAGS + AMX_FLAGS, LIBS, cache), emulated=False)


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, reps: int, before: Callable[[], object] | None
) -> dict[str, float]:
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
    threads = torch.get_num_threads()
    bandwidth = copy_bandwidth()
    evict = cache_evictor()
    print(f"{threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)")
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"as built": NativeKernel.build()}
        kernels.update({name: variant_kernel(name, Path(tmp)) for name in SOURCE_EDITS})
        for heads in (16, 128):
            layer, query, kv_cache, metadata = decode_problem(16, heads, 4096, 64)
            built = CpuAmxMetadataBuilder().build(metadata)
            (group,) = built.extra[PLANS_KEY][plan_key(built)].groups
            tables = group.decode_tables
            assert tables is not None
            out = torch.empty(16, heads, 512, dtype=torch.bfloat16)
            lse = torch.empty(16, heads)
            cache_bytes = 16 * 4096 * 576 * 2
            variants: dict[str, Callable[[], object]] = {}
            for split_threads in (threads, 2 * threads, 4 * threads) if heads == 16 else (threads,):
                layout = group.native_layout(64, heads, split_threads)
                for name, kernel in kernels.items():
                    variants[f"H={heads} {name}, {layout.num_splits} split(s)"] = partial(
                        kernel.decode, query, kv_cache, tables, layout, layer.scale, out, lse
                    )
            impl = CpuAmxMLAImpl(layer)
            variants[f"H={heads} whole attend()"] = partial(
                impl.attend, query, kv_cache, built, return_lse=True
            )
            for label, before in (("L3-warm", None), ("evicted", evict)):
                for name, ms in interleaved(variants, rounds=5, reps=6, before=before).items():
                    share = cache_bytes / (ms / 1e3) / bandwidth
                    print(f"{label:8s} {name:45s} {ms:7.3f} ms  {100 * share:5.1f}% of copy BW", flush=True)
        layer, query, kv_cache, metadata = decode_problem(16, 16, 4096, 64)
        built = CpuAmxMetadataBuilder().build(metadata)
        impl = CpuAmxMLAImpl(layer)
        for n in (4, 8, threads):
            torch.set_num_threads(n)
            ms = interleaved(
                {"": lambda: impl.attend(query, kv_cache, built)}, rounds=3, reps=6, before=evict
            )[""]
            print(f"evicted  H=16 attend() on {n:2d} threads {ms:7.3f} ms", flush=True)
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
