"""jackfield-cuda-mla: the `cuda_mla` attention backend (Triton MLA kernels for NVIDIA GPUs)."""

from __future__ import annotations

from jackfield.hookspecs import hookimpl
from jackfield.specs import AttentionBackendSpec

from jackfield_cuda_mla.capabilities import CUDA_MLA_CAPABILITIES, cuda_mla_availability

JACKFIELD_API = ">=1.0,<2"


@hookimpl
def register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="cuda_mla",
            factory="jackfield_cuda_mla.backend:CudaMLABackend",
            capabilities=CUDA_MLA_CAPABILITIES,
            availability=cuda_mla_availability,
            # Above torch_ref (0): on a GPU `auto` picks the Triton kernels (and CUDA-graph decode).
            priority=50,
            description="Triton MLA decode, sparse decode, fp8 KV and KV insert for NVIDIA GPUs",
        )
    ]
