"""The core conformance kit against torch_ref: on the GPU (full shapes, every declared dtype) and, in
CI, on the CPU under TRITON_INTERPRET=1 (fp16, small shapes) through the same impl with only the
probe relaxed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from jackfield.contracts.attention import AttentionBackend, AttentionRequirements, Availability
from jackfield.testing import AttentionConformance
from jackfield.testing.harness import Case
from jackfield_cuda_attn.backend import CudaAttnBackend


class InterpretedCudaAttnBackend(CudaAttnBackend):
    """cuda_attn's kernels in Triton's CPU interpreter: same impl, CPU device, the probe says yes.

    Only fp16 activations (the interpreter mishandles bf16 tl.dot) and the "auto" cache: the
    interpreter rounds fp32 -> bf16 / fp8 casts loosely, so converting caches are compared on the
    GPU class below instead (and fp8 by tests/test_attention.py within the interpreter's rounding).
    """

    capabilities = dataclasses.replace(
        CudaAttnBackend.capabilities,
        devices=("cpu",),
        activation_dtypes=(torch.float16,),
        kv_cache_dtypes=("auto",),
        preferred_block_size=None,  # block sizes 16 and 32 only: the interpreter is slow
    )

    @classmethod
    def availability(cls) -> Availability:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return Availability.no("TRITON_INTERPRET=1 is not set")
        return Availability.yes("Triton CPU interpreter")


class TestCudaAttnInterpreted(AttentionConformance):
    backend_cls = InterpretedCudaAttnBackend
    device = "cpu"


@pytest.mark.gpu
class TestCudaAttnOnGPU(AttentionConformance):
    backend_cls = CudaAttnBackend
    device = "cuda"
    num_heads = 32
    mha_num_kv_heads = 8
    mha_head_size = 128

    def cases(self, backend: type[AttentionBackend]) -> dict[str, list[Case]]:
        """The record's cross product less float16 activations over a "bfloat16" cache, which
        validate() refuses (test_validate_refuses_float16_over_a_bfloat16_cache)."""
        return {test: [c for c in cases if not (c.dtype == torch.float16 and c.kv_cache_dtype == "bfloat16")]
                for test, cases in super().cases(backend).items()}


def test_validate_refuses_float16_over_a_bfloat16_cache() -> None:
    """The kernels read a 16-bit cache in the query's format: doctor and selection say so before
    a model loads, instead of the first step failing in the kernel's entry check."""
    req = AttentionRequirements(kind="mha", dtype=torch.float16, head_size=128, block_size=64,
                                device="cuda", kv_cache_dtype="bfloat16")
    assert any('kv_cache_dtype "bfloat16" with float16' in r for r in CudaAttnBackend.validate(req))
    fine = (dataclasses.replace(req, kv_cache_dtype="auto"), dataclasses.replace(req, dtype=torch.bfloat16))
    for ok in fine:
        assert not any("kv_cache_dtype" in r for r in CudaAttnBackend.validate(ok))
