"""The native AMX decode kernel alone on an AMX host, against the host copy bandwidth of the run.

At B=16, S=4096, block 64, kv_lora_rank 512 + rope 64 (75.5 MB of cache a step):
- H=16: the package's build and source variants (prefetch distance; other sources given with
  --source, e.g. an earlier version) at several split counts; then attend() taken apart (kernel
  alone, kernel with fresh outputs, the native call without attend's checks, attend()).
- H=128: the build, and variants that skip one phase each (scores, value pack, P x V): their
  outputs are garbage, their times say what each phase costs.
- attend() at H=16 on 4, 8 and all threads.
With the cache in L3 ("L3-warm") and evicted before each call. Variants take turns over rounds
(medians). Source variants are built from edited copies of native/mla_decode.c in a temporary
cache.

    PYTHONPATH=core/src:plugins/cpu_amx/src:benchmarks \
        python3 plugins/cpu_amx/scripts/native_probe.py [--source LABEL=PATH ...]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from amx_probe import interleaved
from bench_cpu_mla import cache_evictor, copy_bandwidth, decode_problem
from jackfield_cpu_amx.backend import CpuAmxMLAImpl
from jackfield_cpu_amx.native import AMX_FLAGS, COMMON_FLAGS, LIBS, SOURCE, NativeKernel
from jackfield_cpu_amx.native_build import build_library
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder, DecodeTables, NativeLayout, plan_key

CACHE_BYTES = 16 * 4096 * 576 * 2
PREFETCH_DEFINE = "#define PREFETCH_CHUNKS_AHEAD 2"
PREFETCH_VARIANTS = {
    "no prefetch": ("prefetch_some(&pf, prefetch_per_step);", ""),
    "prefetch 1 ahead": (PREFETCH_DEFINE, "#define PREFETCH_CHUNKS_AHEAD 1"),
}
SKIP_VARIANTS = {
    "skip scores": ("for (int s = 0; s < ksteps; s++) {", "for (int s = 0; s < 0; s++) {"),
    "skip value pack": ("pack_values(p, k_tile, PAIRS_PER_PTILE * pair_tiles, keys, buf->v_pairs);", ""),
    "skip P x V": ("for (int c0 = 0; c0 < tiles; c0 += 4) {", "for (int c0 = 0; c0 < 0; c0 += 4) {"),
}


def edited_kernel(name: str, edit: tuple[str, str], cache: Path) -> NativeKernel:
    old, new = edit
    text = SOURCE.read_text()
    assert text.count(old) == 1, name
    return source_kernel(name, text.replace(old, new), cache)


def source_kernel(name: str, text: str, cache: Path) -> NativeKernel:
    source = cache / f"{''.join(c if c.isalnum() else '_' for c in name)}.c"
    source.write_text(text)
    return NativeKernel(build_library(source, COMMON_FLAGS + AMX_FLAGS, LIBS, cache))


def decode_into_fresh_outputs(
    kernel: NativeKernel,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: DecodeTables,
    layout: NativeLayout,
    scale: float,
) -> None:
    """As attend() does: the outputs allocated for the call."""
    out = torch.empty(*query.shape[:2], 512, dtype=torch.bfloat16)
    kernel.decode(query, kv_cache, tables, layout, scale, out, torch.empty(query.shape[:2]))


def report(variants: dict[str, Callable[[], object]], bandwidth: float, evict: Callable[[], object]) -> None:
    for label, before in (("L3-warm", None), ("evicted", evict)):
        for name, ms in interleaved(variants, rounds=5, reps=6, before=before).items():
            share = CACHE_BYTES / (ms / 1e3) / bandwidth
            print(f"{label:8s} {name:50s} {ms:7.3f} ms  {100 * share:5.1f}% of copy BW", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", default=[], help="LABEL=PATH of another mla_decode.c")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    bandwidth = copy_bandwidth()
    evict = cache_evictor()
    print(f"{threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        kernels = {"as built": NativeKernel.build()}
        for label_path in args.source:
            label, path = label_path.split("=", 1)
            kernels[label] = source_kernel(label, Path(path).read_text(), cache)
        kernels.update({name: edited_kernel(name, edit, cache) for name, edit in PREFETCH_VARIANTS.items()})
        skips = {name: edited_kernel(name, edit, cache) for name, edit in SKIP_VARIANTS.items()}

        for heads in (16, 128):
            layer, query, kv_cache, metadata = decode_problem(16, heads, 4096, 64)
            built = CpuAmxMetadataBuilder().build(metadata)
            (group,) = built.extra[PLANS_KEY][plan_key(built)].groups
            tables = group.decode_tables
            assert tables is not None
            out = torch.empty(16, heads, 512, dtype=torch.bfloat16)
            lse = torch.empty(16, heads)
            impl = CpuAmxMLAImpl(layer, native_kernel=kernels["as built"])
            default = group.native_layout(64, heads, threads)
            variants: dict[str, Callable[[], object]] = {}
            if heads == 16:
                for layout_threads in (max(1, threads // 4), max(1, threads // 2), threads, 2 * threads):
                    layout = group.native_layout(64, heads, layout_threads)
                    for name, kernel in kernels.items():
                        variants[f"H={heads} {name}, {layout.num_splits} split(s)"] = partial(
                            kernel.decode, query, kv_cache, tables, layout, layer.scale, out, lse
                        )

                variants[f"H={heads} as built, fresh out/lse"] = partial(
                    decode_into_fresh_outputs,
                    kernels["as built"],
                    query,
                    kv_cache,
                    tables,
                    default,
                    layer.scale,
                )
                variants[f"H={heads} impl._decode_native"] = partial(
                    impl._decode_native, group, query, kv_cache, out, lse
                )
            else:
                for name, kernel in {"as built": kernels["as built"], **skips}.items():
                    variants[f"H={heads} {name}, {default.num_splits} split(s)"] = partial(
                        kernel.decode, query, kv_cache, tables, default, layer.scale, out, lse
                    )
            variants[f"H={heads} attend()"] = partial(impl.attend, query, kv_cache, built, return_lse=True)
            report(variants, bandwidth, evict)

        layer, query, kv_cache, metadata = decode_problem(16, 16, 4096, 64)
        built = CpuAmxMetadataBuilder().build(metadata)
        impl = CpuAmxMLAImpl(layer, native_kernel=kernels["as built"])
        for n in (4, 8, threads):
            torch.set_num_threads(n)
            ms = interleaved(
                {"": partial(impl.attend, query, kv_cache, built)}, rounds=3, reps=6, before=evict
            )[""]
            print(f"evicted  H=16 attend() on {n:2d} threads {ms:7.3f} ms", flush=True)
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
