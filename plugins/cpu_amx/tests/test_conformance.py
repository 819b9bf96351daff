"""cpu_amx held to torch_ref by the core conformance kit, on the detected compute path."""

from __future__ import annotations

import torch
from jackfield.testing import AttentionConformance
from jackfield_cpu_amx.backend import CpuAmxBackend


class TestCpuAmxBfloat16(AttentionConformance):
    backend_cls = CpuAmxBackend
    device = "cpu"
    dtype = torch.bfloat16


class TestCpuAmxFloat32(AttentionConformance):
    backend_cls = CpuAmxBackend
    device = "cpu"
    dtype = torch.float32
