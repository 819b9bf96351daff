"""jackfield-rocm-aiter: the `rocm_aiter_mla` attention backend (AITER's MLA decode for AMD GPUs)."""

from __future__ import annotations

from jackfield.hookspecs import hookimpl
from jackfield.specs import AttentionBackendSpec

from jackfield_rocm_aiter.capabilities import ROCM_AITER_MLA_CAPABILITIES, rocm_aiter_availability

JACKFIELD_API = ">=1.0,<2"


@hookimpl
def register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="rocm_aiter_mla",
            factory="jackfield_rocm_aiter.backend:RocmAiterMLABackend",
            capabilities=ROCM_AITER_MLA_CAPABILITIES,
            availability=rocm_aiter_availability,
            # Above cuda_mla (50): on an AMD GPU with AITER, `auto` takes AITER's kernels.
            priority=60,
            description="AITER's MLA decode kernels for AMD GPUs (ROCm); prefill by the expanded form",
        )
    ]
