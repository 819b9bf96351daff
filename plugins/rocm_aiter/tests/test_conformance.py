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
        bits where torch_ref keeps bf16's 8. Over 30 seeds at 16 and 128 heads the emulated
        outputs were within 0.085 of the output's scale and the LSEs within 0.2 (rows of few keys:
        the LSE is about one logit's rounding). test_backend.py checks the fp8 path tightly
        against the attention of the quantized query."""
        return 0.25 if kv_cache_dtype == "fp8_e4m3" else super().tolerance(dtype, kv_cache_dtype)


class TestGfx950(DeepSeekShapes):
    """MI350: bf16 and fp8 caches, non-causal multi-token decode over fp8 (msk0 kernels)."""

    backend_cls = emulated_backend(EmulatedAiter("gfx950"))


def declaring(
    backend: type[AttentionBackend], kv_cache_dtypes: tuple[KVCacheDType, ...]
) -> type[AttentionBackend]:
    """`backend` declaring only these caches (the kit generates its cases from the declaration)."""
    caps = dataclasses.replace(backend.capabilities, kv_cache_dtypes=kv_cache_dtypes)
    return type(backend.__name__, (backend,), {"capabilities": caps})


class TestGfx950With128Heads(DeepSeekShapes):
    """128 heads: one kernel for every query length. "auto" is "bfloat16" for bf16 activations
    (the 16-head class runs both)."""

    backend_cls = declaring(emulated_backend(EmulatedAiter("gfx950")), ("bfloat16", "fp8_e4m3"))
    num_heads = 128


class TestGfx942(DeepSeekShapes):
    """MI300: causal kernels only. Its AITER reads fp8 as float8_e4m3fnuz, which a Jackfield fp8
    cache is not: validate() refuses fp8 there (test_backend.py), so the kit runs 16-bit caches."""

    backend_cls = declaring(emulated_backend(EmulatedAiter("gfx942")), ("auto", "bfloat16"))
