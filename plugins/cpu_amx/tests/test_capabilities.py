"""Path selection (faked CPU flags, faked OS refusal), availability, and registration."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
from jackfield.plugins import load_registry
from jackfield_cpu_amx import capabilities
from jackfield_cpu_amx.capabilities import amx_status, availability, read_cpu_flags

AMX_CPU = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})


def granted() -> None:
    return None


def test_amx_flags_and_os_grant_select_amx() -> None:
    status = amx_status(AMX_CPU, request_permission=granted)
    assert status.enabled and status.path == "amx_bf16"
    assert "granted" in availability(status).reason and "amx_bf16" in availability(status).reason


@pytest.mark.parametrize("missing", ["amx_tile", "amx_bf16"])
def test_missing_amx_flag_selects_avx512(missing: str) -> None:
    asked: list[bool] = []
    status = amx_status(AMX_CPU - {missing}, request_permission=lambda: asked.append(True))
    assert not status.enabled and status.path == "avx512_fp32"
    assert missing in status.reason and "AVX-512 float32" in status.reason
    assert not asked  # no AMX flags: the OS is never asked


def test_cpu_without_avx512_says_so() -> None:
    status = amx_status(frozenset({"sse4_2", "avx2"}), request_permission=granted)
    assert not status.enabled and "no AVX-512" in status.reason


def test_os_refusal_selects_avx512_and_names_the_refusal() -> None:
    status = amx_status(
        AMX_CPU, request_permission=lambda: "the kernel refused ARCH_REQ_XCOMP_PERM (errno 22)"
    )
    assert not status.enabled and status.path == "avx512_fp32"
    assert "ARCH_REQ_XCOMP_PERM" in status.reason and "errno 22" in status.reason


def test_read_cpu_flags_parses_the_first_flags_line(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16\n\nflags\t\t: other\n")
    assert read_cpu_flags(str(cpuinfo)) == frozenset({"fpu", "avx512f", "amx_tile", "amx_bf16"})
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_this_machine_detection_agrees_with_its_flags() -> None:
    """On an AMX CPU (the GPU machine's Xeon) Linux grants the tiles; elsewhere the path is AVX-512."""
    flags = read_cpu_flags()
    status = capabilities.detected_amx_status()
    assert status.enabled == ({"amx_tile", "amx_bf16"} <= flags), status.reason
    assert status.enabled == capabilities.is_amx_bmm_enabled()
    if status.enabled:  # PyTorch's own probe (cpuinfo + the same arch_prctl grant) agrees
        assert torch.cpu._is_amx_tile_supported()


def test_non_x86_machine_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    answer = availability(amx_status(frozenset(), request_permission=granted))
    assert not answer.ok and "aarch64" in answer.reason


def test_plugin_registers_cpu_amx_with_its_path_in_the_reason() -> None:
    registry = load_registry()
    entry = registry.lookup("attention", "cpu_amx")
    assert entry.distribution == "jackfield-cpu-amx"
    info = next(p for p in registry.plugins if p.distribution == "jackfield-cpu-amx")
    assert info.status == "active" and "attention:cpu_amx" in info.registers
    reason = entry.spec.availability().reason
    assert reason.startswith(capabilities.detected_amx_status().path)


@pytest.mark.skipif(
    not capabilities.is_amx_bmm_enabled(),
    reason="needs AMX hardware: AMX-BF16 granted by the OS (the GPU machine's Xeon)",
)
def test_bf16_bmm_runs_on_onednn_amx_kernels() -> None:
    """On an AMX host the bf16 products this backend issues reach oneDNN's AMX kernels."""
    script = "import torch; a = torch.randn(4, 64, 576).bfloat16(); torch.bmm(a, a.transpose(1, 2))"
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    log = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "amx" in log, log[-2000:]
