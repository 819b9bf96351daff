"""KV offload to the CPU tier (plugins/kv_offload, `cpu_offload`): transfer rate, time to first
token of an evicted prefix, and LRU vs ARC hit rates.

1. Host <-> device GB/s of the connector's host pool (every layer of a Llama-3.2-1B-shaped KV
   cache, chunks of scattered blocks, on its own streams) against a plain pinned copy of the same
   bytes measured in the same run (target: >= 80% of it).
2. Time to first token of a request whose 8k-token prefix was evicted from the device prefix
   cache but kept on the CPU tier, against the same engine without offload recomputing it
   (target: >= 5x faster; LMCache reports 3-10x), with each of cpu_offload's load modes:
   layerwise (the request computes in the step that loads it, layer i's compute overlapping the
   later layers' copies) and async (a load step, then a compute step). The device pool is kept
   small (engine.max_model_len and max_num_seqs cap it) and filler requests push the prefix out.
3. LRU vs ARC hit rate of the CPU tier's manager on a mixed workload (a hot set of shared
   prefixes under a scan of one-off prompts), no device needed.

  python benchmarks/bench_offload.py --device cuda --append benchmarks/RESULTS.md
  python benchmarks/bench_offload.py --device cpu --small        # the same code paths, small shapes
"""

from __future__ import annotations

import argparse
import datetime
import random
import time

import torch
from bench_e2e import LLAMA_1B, LLAMA_SMALL, build_hf_model
from jackfield import LLM, SamplingParams
from jackfield.attention.kv_cache import allocate_kv_cache
from jackfield.contracts.attention import AttentionLayerSpec
from jackfield.contracts.kv_connector import KVConnectorContext, KVCoverageSpec
from jackfield.ops.staging import host_empty
from jackfield_kv_offload.keys import ChunkKey
from jackfield_kv_offload.manager import OffloadManager
from jackfield_kv_offload.policies import make_policy
from jackfield_kv_offload.transfer import HostPool

BLOCK = 16


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Mean seconds of fn() over `reps` runs after one warm-up."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def transfer_rates(device: str, shape: dict[str, int], tokens: int, blocks_per_chunk: int,
                   reps: int) -> dict[str, float]:
    """GB/s of a plain pinned copy and of the host pool, each direction, over one request's KV."""
    layers = shape["num_hidden_layers"]
    spec = AttentionLayerSpec(num_heads=shape["num_attention_heads"], head_size=64, scale=0.125,
                              num_kv_heads=shape["num_key_value_heads"])
    num_blocks = 2 * tokens // BLOCK
    caches = tuple(allocate_kv_cache(spec, num_blocks, BLOCK, torch.bfloat16, device) for _ in range(layers))
    context = KVConnectorContext(options={}, block_size=BLOCK, coverage=(KVCoverageSpec(BLOCK),),
                                 lookahead_tokens=0, layers=(spec,) * layers, layer_group=(0,) * layers,
                                 kv_caches=caches, device=torch.device(device))
    chunks = tokens // BLOCK // blocks_per_chunk
    pool = HostPool(context, blocks_per_chunk, chunks)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    scattered = order[: chunks * blocks_per_chunk]
    pairs = list(enumerate(scattered.tolist()))  # host row r <- device block
    nbytes = pool.nbytes

    def store() -> None:
        for layer in range(layers):
            pool.store_layer(layer, pairs)
        if pool.store_stream is not None:
            pool.store_stream.synchronize()

    def load() -> None:
        for layer in range(layers):
            pool.load_layer(layer, pairs)
        if pool.load_stream is not None:
            pool.load_stream.synchronize()

    host = host_empty((nbytes,), torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return {
        "bytes": nbytes,
        "plain_d2h": nbytes / timed(lambda: host.copy_(dev, non_blocking=True), device, reps) / 1e9,
        "plain_h2d": nbytes / timed(lambda: dev.copy_(host, non_blocking=True), device, reps) / 1e9,
        "pool_store": nbytes / timed(store, device, reps) / 1e9,
        "pool_load": nbytes / timed(load, device, reps) / 1e9,
    }


def ttft(device: str, small: bool, prefix_tokens: int, blocks_per_chunk: int) -> dict[str, float]:
    """Seconds to the first token of prefix + 16 new tokens, the prefix evicted from the device:
    recomputed (no connector) and loaded from the CPU tier in each load mode."""
    shape = LLAMA_SMALL if small else LLAMA_1B
    _, directory = build_hf_model("llama", small, None, "cpu", torch.bfloat16, max_len=prefix_tokens + 64)
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prefix = [rng.randrange(vocab) for _ in range(prefix_tokens)]
    fillers = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(3)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    base = {"engine.device": device, "model.dtype": "bfloat16" if device == "cuda" else "float32",
            "engine.block_size": BLOCK, "engine.max_num_seqs": 2,
            "engine.max_model_len": prefix_tokens + 64, "engine.max_num_batched_tokens": 8192}
    results = {}
    runs: list[tuple[str, dict[str, object]]] = [("recompute", {})]
    for mode in ("layerwise", "async"):
        runs.append((mode, {"kv_connector.name": "cpu_offload", "kv_connector.options": {
            "cpu_gib": 16.0, "blocks_per_chunk": blocks_per_chunk, "load_mode": mode}}))
    for name, extra in runs:
        llm = LLM(directory, **{**base, **extra})
        times = []
        for trial in range(3):
            tail = [rng.randrange(vocab) for _ in range(16)]
            llm.generate([prefix + [trial]], one)  # computed (and, with the connector, stored)
            for filler in fillers:  # 2 x max_num_seqs requests' worth: the prefix leaves the device pool
                llm.generate([filler + [trial]], one)
            out = llm.generate([prefix + tail], one)[0]
            times.append(out.timings.time_to_first_token_s)
        results[name] = min(times)
        stats = llm.engine.kv_connector_stats()
        if stats is not None:
            assert stats["hit_tokens"] > 0, "the prefix was not served from the CPU tier"
    return results


def hit_rates(capacity: int, requests: int, seed: int) -> dict[str, float]:
    """Chunk hit rate per policy: 70% of requests reuse one of 24 hot prefixes (Zipf-like), 30%
    are one-off scans; each request is 4 chunks (a lookup, then a store of what missed)."""
    results = {}
    for policy in ("lru", "arc"):
        rng = random.Random(seed)
        manager = OffloadManager(capacity, make_policy(policy, capacity))
        hits = total = 0
        for r in range(requests):
            if rng.random() < 0.7:
                base = int(24 * rng.random() ** 2)  # hot prefixes, lower ids hotter
            else:
                base = 1_000 + r  # a one-off prompt
            keys = [ChunkKey(0, base * 16 + c) for c in range(4)]
            found = manager.lookup(keys)
            manager.touch(keys)
            hits, total = hits + found, total + len(keys)
            plan = manager.prepare_store(keys)
            if plan is not None:
                manager.complete_store(plan.keys, True)
        results[policy] = hits / total
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (the CPU check of the code paths)")
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    parser.add_argument("--append", help="append the results to this markdown file")
    args = parser.parse_args()
    shape = LLAMA_SMALL if args.small else LLAMA_1B
    prefix = min(args.prefix_tokens, 512) if args.small else args.prefix_tokens
    rates = transfer_rates(args.device, shape, prefix, args.blocks_per_chunk, reps=3 if args.small else 10)
    first = ttft(args.device, args.small, prefix, args.blocks_per_chunk)
    hits = hit_rates(capacity=64, requests=4000, seed=0)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    lines = [
        f"### bench_offload ({datetime.date.today()}, {where}, "
        f"`python benchmarks/bench_offload.py --device {args.device}{' --small' if args.small else ''}`)",
        "",
        f"KV of {prefix} tokens ({rates['bytes'] / 2**20:.0f} MiB, {shape['num_hidden_layers']} layers, "
        f"{args.blocks_per_chunk} blocks of {BLOCK} tokens a chunk):",
        "",
        "| direction | plain pinned copy GB/s | host pool GB/s | ratio |",
        "| --- | --- | --- | --- |",
        f"| device -> host (store) | {rates['plain_d2h']:.1f} | {rates['pool_store']:.1f} | "
        f"{rates['pool_store'] / rates['plain_d2h']:.2f} |",
        f"| host -> device (load) | {rates['plain_h2d']:.1f} | {rates['pool_load']:.1f} | "
        f"{rates['pool_load'] / rates['plain_h2d']:.2f} |",
        "",
        f"Time to first token, {prefix}-token prefix evicted from the device: recompute "
        f"{first['recompute'] * 1e3:.1f} ms; from the CPU tier, layerwise load "
        f"{first['layerwise'] * 1e3:.1f} ms ({first['recompute'] / first['layerwise']:.1f}x), async load "
        f"{first['async'] * 1e3:.1f} ms ({first['recompute'] / first['async']:.1f}x).",
        "",
        f"Hit rate, 64-chunk tier, hot prefixes under a scan: LRU {hits['lru']:.3f}, "
        f"ARC {hits['arc']:.3f}.",
        "",
    ]
    print("\n".join(lines))
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
