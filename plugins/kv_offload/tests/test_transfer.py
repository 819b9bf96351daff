"""Byte-exact round trips through the host pool: bf16 and fp8 caches, MLA and MHA layouts, KV
groups sharing cache tensors; blocks outside a transfer are untouched. Runs on the CPU here and,
marked `gpu`, between an H200 and pinned host memory."""

from __future__ import annotations

import pytest
import torch
from jackfield.attention.kv_cache import allocate_kv_cache
from jackfield.contracts.attention import AttentionLayerSpec
from jackfield.contracts.kv_connector import ConnectorMetadata, KVConnectorContext, KVCoverageSpec
from jackfield_kv_offload.connector import CpuOffloadWorker, TransferJob
from jackfield_kv_offload.transfer import HostPool

MLA = AttentionLayerSpec(num_heads=4, head_size=40, scale=0.1, kv_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16)
MHA = AttentionLayerSpec(num_heads=4, head_size=8, scale=0.1, num_kv_heads=2)
BLOCK, NUM_BLOCKS, BPC = 4, 24, 2


def context(layer: AttentionLayerSpec, dtype: torch.dtype, groups: int, device: str,
            seed: int) -> KVConnectorContext:
    """`groups` KV cache groups of two layers each sharing two cache tensors (tensor j serves the
    j-th layer of every group), filled with random bytes."""
    g = torch.Generator().manual_seed(seed)
    tensors = [allocate_kv_cache(layer, NUM_BLOCKS, BLOCK, torch.float32, "cpu").to(dtype) for _ in range(2)]
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    tensors = [t.to(device) for t in tensors]
    return KVConnectorContext(options={}, block_size=BLOCK, coverage=(KVCoverageSpec(BLOCK),) * groups,
                              lookahead_tokens=0, layers=(layer,) * (2 * groups),
                              layer_group=tuple(g for g in range(groups) for _ in range(2)),
                              kv_caches=tuple(tensors[j] for _ in range(groups) for j in range(2)),
                              device=torch.device(device))


def block(cache: torch.Tensor, mla: bool, b: int) -> torch.Tensor:
    raw = cache.view(torch.uint8)
    return (raw[b] if mla else raw[:, b]).clone()


def round_trip(device: str, layer: AttentionLayerSpec, dtype: torch.dtype, groups: int, seed: int) -> None:
    print(f"seed={seed}")
    ctx = context(layer, dtype, groups, device, seed)
    mla = layer.kv_lora_rank > 0
    pool = HostPool(ctx, BPC, num_slots=6)
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    # per group: two chunks (slots 2g, 2g+1) of scattered device blocks
    sources = {grp: order[4 * grp : 4 * grp + 4] for grp in range(groups)}
    targets = {grp: order[12 + 4 * grp : 12 + 4 * grp + 4] for grp in range(groups)}
    expected = {(layer_i, b): block(ctx.kv_caches[layer_i], mla, b)
                for layer_i in range(len(ctx.layers)) for b in sources[ctx.layer_group[layer_i]]}
    untouched = [b for b in range(NUM_BLOCKS) if all(b not in t for t in targets.values())]
    before = [[block(c, mla, b) for b in untouched] for c in ctx.kv_caches[:2]]
    for layer_i, grp in enumerate(ctx.layer_group):
        pool.store_layer(layer_i, [(2 * grp * BPC + j, b) for j, b in enumerate(sources[grp])])
    for layer_i, grp in enumerate(ctx.layer_group):
        pool.load_layer(layer_i, [(2 * grp * BPC + j, b) for j, b in enumerate(targets[grp])])
    if device == "cuda":
        torch.cuda.synchronize()
    for layer_i, grp in enumerate(ctx.layer_group):
        for src, dst in zip(sources[grp], targets[grp], strict=True):
            got = block(ctx.kv_caches[layer_i], mla, dst)
            assert torch.equal(got, expected[layer_i, src]), (layer_i, dst)
    for t, saved in zip(ctx.kv_caches[:2], before, strict=True):
        assert all(torch.equal(block(t, mla, b), s) for b, s in zip(untouched, saved, strict=True))


CASES = [(MLA, torch.bfloat16, 1), (MLA, torch.float8_e4m3fn, 1), (MHA, torch.bfloat16, 1),
         (MHA, torch.float8_e4m3fn, 1), (MHA, torch.bfloat16, 3), (MLA, torch.float8_e4m3fn, 2)]


@pytest.mark.parametrize(("layer", "dtype", "groups"), CASES)
def test_round_trip_is_byte_exact(layer: AttentionLayerSpec, dtype: torch.dtype, groups: int,
                                  rng_seed: int) -> None:
    round_trip("cpu", layer, dtype, groups, seed=rng_seed % 2**31)  # asserts every block it moved


@pytest.mark.gpu
@pytest.mark.parametrize(("layer", "dtype", "groups"), CASES)
def test_round_trip_is_byte_exact_on_cuda(layer: AttentionLayerSpec, dtype: torch.dtype, groups: int,
                                          rng_seed: int) -> None:
    round_trip("cuda", layer, dtype, groups, seed=rng_seed % 2**31)  # asserts every block it moved


def test_chunk_bytes_count_each_shared_tensor_once() -> None:
    ctx = context(MHA, torch.bfloat16, 3, "cpu", seed=33)
    per_block = 2 * BLOCK * MHA.num_kv_heads * MHA.head_size * 2  # key and value, bf16
    assert HostPool.chunk_bytes(ctx, BPC) == 2 * per_block * BPC  # two distinct tensors


@pytest.mark.gpu
def test_a_layer_reads_its_blocks_only_after_its_copy_on_cuda() -> None:
    """Layerwise loads on a real stream: a sleep kernel queued on the load stream ahead of the
    copies holds them back, so a compute-stream read that did not wait for its layer's event
    would see the old bytes; after `wait_for_layer_load(layer)` it sees the loaded ones."""
    seed = 34
    print(f"seed={seed}")
    ctx = context(MHA, torch.bfloat16, 1, "cuda", seed)
    pool = HostPool(ctx, BPC, num_slots=6)
    worker = CpuOffloadWorker(pool, ctx.layer_group, layerwise=True)
    g = torch.Generator().manual_seed(seed + 1)
    for host in pool.host:  # the chunks to load: random bytes
        raw = host.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    targets = (torch.randperm(NUM_BLOCKS - 1, generator=g)[: 2 * BPC] + 1).tolist()
    pairs = tuple(enumerate(targets))  # host rows 0.. -> scattered device blocks
    ids = torch.tensor(targets, device="cuda")
    expected = [[host[: len(targets)].clone().cuda() for host in pool.host[pool.cache.layer_tensor[layer]]]
                for layer in range(len(ctx.layers))]
    metadata = ConnectorMetadata({"loads": [TransferJob("0", (pairs,))], "stores": []})
    with torch.cuda.stream(pool.load_stream):
        torch.cuda._sleep(1 << 28)  # a few hundred ms: the copies queued next start late
    worker.start_load_kv(metadata, ctx.kv_caches)
    read = []
    for layer in range(len(ctx.layers)):  # as the forward goes: wait, then attend (read)
        worker.wait_for_layer_load(layer)
        read.append([plane.index_select(0, ids) for plane in pool.cache.of_layer(layer)])
    torch.cuda.synchronize()
    for layer, (got, want) in enumerate(zip(read, expected, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), layer
