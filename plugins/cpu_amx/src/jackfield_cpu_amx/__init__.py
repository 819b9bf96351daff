"""jackfield-cpu-amx: the `cpu_amx` attention backend (MLA and MHA/GQA/MQA) for x86 CPUs (Intel
AMX-BF16, AVX-512)."""

from __future__ import annotations

import jackfield
from jackfield.specs import AttentionBackendSpec

from jackfield_cpu_amx.capabilities import CPU_AMX_CAPABILITIES, availability, is_amx_bmm_enabled

JACKFIELD_API = ">=1.0,<2"
__all__ = ["JACKFIELD_API", "is_amx_bmm_enabled", "register_attention_backends"]


@jackfield.hookimpl
def register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="cpu_amx",
            factory="jackfield_cpu_amx.backend:CpuAmxBackend",
            capabilities=CPU_AMX_CAPABILITIES,
            availability=availability,
            priority=20,  # above torch_ref on CPUs
            description="MLA and MHA/GQA on x86 CPUs: bfloat16 products on AMX tiles, float32 otherwise",
        )
    ]
