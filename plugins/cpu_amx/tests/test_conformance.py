"""cpu_amx held to torch_ref by the core conformance kit, on the detected compute path."""

from __future__ import annotations

import pytest
import torch
from jackfield.testing import AttentionConformance
from jackfield_cpu_amx import backend
from jackfield_cpu_amx.backend import CpuAmxBackend
from jackfield_cpu_amx.capabilities import AmxStatus


class TestCpuAmx(AttentionConformance):
    backend_cls = CpuAmxBackend
    device = "cpu"


class TestCpuAmxFloat32OnTheAmxPath(AttentionConformance):
    """The AMX host's float32 run, on any CPU: the impl believes AMX was detected (its products
    still run wherever oneDNN runs them), and a float32 request must keep float32 precision."""

    backend_cls = CpuAmxBackend
    device = "cpu"
    dtypes = (torch.float32,)

    @pytest.fixture(autouse=True)
    def _fake_amx_detection(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(backend, "detected_amx_status", lambda: AmxStatus(True, "faked for the test"))
