"""The availability probe fails closed with the reason, on this machine (no ROCm) and on faked
ones: ROCm without aiter, AITER (the emulator) on a known arch, on an arch without a manifest."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from jackfield_rocm_aiter.platform import gfx_arch, platform_from, probe_platform

from .aiter_emulator import FIXTURES, EmulatedAiter, EmulatedAiterWithoutCausal


@pytest.mark.parametrize(("name", "arch"), [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx950", "gfx950"),
                                            ("gfx90a:sramecc-:xnack+", "gfx90a")])
def test_the_arch_is_read_from_gcn_arch_name(name: str, arch: str) -> None:
    assert gfx_arch(name) == arch


@pytest.mark.parametrize("name", ["", "NVIDIA H200", ":xnack-"])
def test_a_gcn_arch_name_without_an_arch_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="names no gfx arch"):
        gfx_arch(name)


def test_not_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    probe = probe_platform.__wrapped__()
    assert probe.platform is None
    assert probe.reason == "not a ROCm build of PyTorch (torch.version.hip is None)"


def test_rocm_without_a_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe_platform.__wrapped__().reason == "no ROCm GPU is visible to PyTorch"


@pytest.fixture
def faked_rocm(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A ROCm build of PyTorch with a visible MI350 (gcnArchName faked), AITER_ASM_DIR unset."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=0: props)
    monkeypatch.delenv("AITER_ASM_DIR", raising=False)
    return monkeypatch


def install_aiter(monkeypatch: pytest.MonkeyPatch, aiter: EmulatedAiter) -> None:
    """The emulator as the `aiter` package (aiter.dtypes.fp8, aiter.mla.mla_decode_fwd)."""
    package, mla = types.ModuleType("aiter"), types.ModuleType("aiter.mla")
    package.dtypes = types.SimpleNamespace(fp8=aiter.fp8)  # type: ignore[attr-defined]
    mla.mla_decode_fwd = aiter.mla_decode_fwd  # type: ignore[attr-defined]
    package.mla = mla  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aiter", package)
    monkeypatch.setitem(sys.modules, "aiter.mla", mla)


def test_rocm_without_aiter(faked_rocm: pytest.MonkeyPatch) -> None:
    faked_rocm.setitem(sys.modules, "aiter", None)  # what an uninstalled package imports as
    probe = probe_platform.__wrapped__()
    assert probe.platform is None
    assert probe.reason.startswith("aiter is not importable (ModuleNotFoundError: ")


def test_rocm_with_aiter_on_a_known_arch(faked_rocm: pytest.MonkeyPatch) -> None:
    install_aiter(faked_rocm, EmulatedAiter("gfx950"))
    faked_rocm.setenv("AITER_ASM_DIR", str(FIXTURES))
    probe = probe_platform.__wrapped__()
    assert probe.availability().ok, probe.reason
    assert probe.platform is not None and probe.platform.arch == "gfx950"
    assert probe.platform.fp8_dtype == torch.float8_e4m3fn and probe.platform.decode_takes_causal
    assert "21 kernels" in probe.reason


def test_rocm_with_aiter_that_set_no_asm_dir(faked_rocm: pytest.MonkeyPatch) -> None:
    install_aiter(faked_rocm, EmulatedAiter("gfx950"))
    assert probe_platform.__wrapped__().reason == "AITER_ASM_DIR is not set after importing aiter"


def test_an_arch_without_a_manifest(faked_rocm: pytest.MonkeyPatch) -> None:
    install_aiter(faked_rocm, EmulatedAiter("gfx950"))
    faked_rocm.setenv("AITER_ASM_DIR", str(FIXTURES))
    props = types.SimpleNamespace(gcnArchName="gfx1100")
    faked_rocm.setattr(torch.cuda, "get_device_properties", lambda device=0: props)
    probe = probe_platform.__wrapped__()
    assert probe.platform is None
    assert probe.reason == (f"AITER has no MLA kernel manifest for gfx1100 "
                            f"({FIXTURES / 'gfx1100' / 'mla' / 'mla_asm.csv'} does not exist)")


def test_an_unreadable_manifest(tmp_path: Path) -> None:
    (tmp_path / "gfx950" / "mla").mkdir(parents=True)
    (tmp_path / "gfx950" / "mla" / "mla_asm.csv").write_text("qType,kvType\n")
    aiter = EmulatedAiter("gfx950")
    probe = platform_from("gfx950", tmp_path, aiter.fp8, aiter.mla_decode_fwd)
    assert probe.platform is None and probe.reason.startswith("AITER's MLA kernel manifest is unreadable")


def test_the_causal_parameter_is_read_from_the_installed_signature() -> None:
    releases = ((EmulatedAiter("gfx950"), True), (EmulatedAiterWithoutCausal("gfx950"), False))
    for aiter, takes_causal in releases:
        platform = platform_from("gfx950", FIXTURES, aiter.fp8, aiter.mla_decode_fwd).platform
        assert platform is not None and platform.decode_takes_causal is takes_causal
