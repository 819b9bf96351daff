"""torch_ref passes its own conformance kit (MLA and MHA, fp32 and bf16, CPU)."""

import torch
from jackfield.testing import AttentionConformance


class TestTorchRefFloat32(AttentionConformance):
    backend_name = "torch_ref"
    dtype = torch.float32


class TestTorchRefBFloat16(AttentionConformance):
    backend_name = "torch_ref"
    dtype = torch.bfloat16
