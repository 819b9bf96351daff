"""The core conformance kit against torch_ref, through the AITER emulator (no AMD GPU here): the
backend's own impl, builder and checks, with AITER's entry point emulated in float64 on the CPU."""

from __future__ import annotations

import dataclasses

import torch
from jackfield.contracts.attention import AttentionBackend, KVCacheDType
from jackfield.testing import AttentionConformance

from .aiter_emulator import EmulatedAiter
from .emulated import emulated_backend


class DeepSeekShapes(AttentionConformance):
    """AITER's record: kv_lora_rank 512 + rope 64; DeepSeek's nope and v dims."""

    num_heads = 16
    kv_lora_rank = 512
    qk_rope_head_dim = 64
    qk_nope_head_dim = 128
    v_head_dim = 128

    def tolerance(self, dtype: torch.dtype, kv_cache_dtype: KVCacheDType) -> float:
        """Over an fp8 cache AITER takes fp8 queries: each latent query element keeps 3 mantissa
        bits where torch_ref keeps bf16's 8 (the emulator's output was within 0.085 of the
        output's scale over 30 seeds). test_backend.py checks the fp8 path against the quantized
        query exactly."""
        return 0.125 if kv_cache_dtype == "fp8_e4m3" else super().tolerance(dtype, kv_cache_dtype)


class TestGfx950(DeepSeekShapes):
    """MI350: bf16 and fp8 caches, non-causal multi-token decode over fp8 (msk0 kernels)."""

    backend_cls = emulated_backend(EmulatedAiter("gfx950"))


class TestGfx950With128Heads(DeepSeekShapes):
    backend_cls = emulated_backend(EmulatedAiter("gfx950"))
    num_heads = 128


def without_fp8(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """gfx942's AITER reads fp8 as float8_e4m3fnuz, which a Jackfield fp8 cache is not: validate()
    refuses it there (test_backend.py), so the kit runs the 16-bit caches."""
    caps = dataclasses.replace(backend.capabilities, kv_cache_dtypes=("auto", "bfloat16"))
    return type("Gfx942Backend", (backend,), {"capabilities": caps})


class TestGfx942(DeepSeekShapes):
    """MI300: causal kernels only."""

    backend_cls = without_fp8(emulated_backend(EmulatedAiter("gfx942")))
    dtypes = (torch.bfloat16,)
