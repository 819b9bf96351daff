"""The engine's KV cache: how many blocks the budget pays for, and the tensors.

A block id holds one block in each cache tensor. With KV cache groups (kv_groups.py) fewer
tensors than layers exist: tensor j serves the j-th layer of every group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jackfield.attention.kv_cache import allocate_kv_cache, cache_dtype, cache_shape
from jackfield.config import ConfigError, EngineConfig
from jackfield.contracts.attention import AttentionLayerSpec
from jackfield.engine.block_manager import max_request_blocks
from jackfield.engine.kv_groups import KVCacheGroups, plan_kv_cache_groups


@dataclass(frozen=True)
class KVCache:
    groups: KVCacheGroups
    num_blocks: int
    block_size: int
    layer_caches: list[torch.Tensor]  # per layer (layers sharing a tensor get the same one)

    @classmethod
    def allocate(cls, layers: list[AttentionLayerSpec], engine: EngineConfig, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, dcp_size: int = 1) -> KVCache:
        """`dcp_size` > 1: each block holds block_size of every dcp_size * block_size consecutive
        tokens of a request (decode context parallel), so a request needs 1/dcp_size of them."""
        if engine.block_size is None:
            raise ValueError("engine.block_size is None: the Engine resolves it before allocating")
        groups = plan_kv_cache_groups(layers)
        layer_of_tensor = {t: layer for layer, t in zip(layers, groups.layer_tensor, strict=True)}
        num_blocks = _num_blocks(list(layer_of_tensor.values()), groups, engine, max_model_len, dtype, device,
                                 dcp_size)
        try:
            tensors = {t: allocate_kv_cache(layer, num_blocks, engine.block_size, dtype, device)
                       for t, layer in layer_of_tensor.items()}
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # the CPU allocator raises RuntimeError
            setting = "engine.gpu_memory_fraction" if device.type == "cuda" else "engine.cpu_kv_cache_gib"
            raise ConfigError([f"allocating the KV cache ({num_blocks} blocks) failed: lower {setting} "
                               f"or engine.max_num_seqs ({str(exc).splitlines()[0][:200]})"]) from exc
        return cls(groups, num_blocks, engine.block_size, [tensors[t] for t in groups.layer_tensor])


def _num_blocks(tensor_layers: list[AttentionLayerSpec], groups: KVCacheGroups, engine: EngineConfig,
                max_model_len: int, dtype: torch.dtype, device: torch.device, dcp_size: int) -> int:
    """Blocks the budget pays for, capped at what max_num_seqs full-length requests can use."""
    per_block = sum(torch.Size(cache_shape(layer, 1, engine.block_size)).numel()
                    * cache_dtype(layer.kv_cache_dtype, dtype).itemsize for layer in tensor_layers)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * engine.gpu_memory_fraction
        where = f"{engine.gpu_memory_fraction} of the free GPU memory"
    else:
        budget = engine.cpu_kv_cache_gib * 2**30
        where = f"engine.cpu_kv_cache_gib = {engine.cpu_kv_cache_gib}"
    windows = groups.windows
    useful = engine.max_num_seqs * max_request_blocks(
        windows, engine.block_size * dcp_size, max_model_len, engine.max_num_batched_tokens
    ) + any(w is not None for w in windows)  # the null block
    num_blocks = min(int(budget // per_block), useful)
    if num_blocks < 1:
        raise ConfigError([f"the KV cache budget ({where}) does not fit one block of {per_block} bytes"])
    return num_blocks
