"""jackfield-cuda-attn: the `cuda_attn` attention backend (Triton paged attention for NVIDIA GPUs)."""

from __future__ import annotations

from jackfield.hookspecs import hookimpl
from jackfield.specs import AttentionBackendSpec

from jackfield_cuda_attn.capabilities import CUDA_ATTN_CAPABILITIES, cuda_attn_availability

JACKFIELD_API = ">=1.0,<2"


@hookimpl
def register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="cuda_attn",
            factory="jackfield_cuda_attn.backend:CudaAttnBackend",
            capabilities=CUDA_ATTN_CAPABILITIES,
            availability=cuda_attn_availability,
            # Above torch_ref (0): on a GPU `auto` picks the Triton kernels (and CUDA-graph decode).
            priority=50,
            description="Triton paged attention (MHA/GQA/MQA): split-KV decode, FlashAttention-2 prefill",
        )
    ]
