"""Reading AITER's per-arch MLA kernel manifests (fixtures: real rows of ROCm/aiter's
hsa/gfx942/mla/mla_asm.csv and hsa/gfx950/mla/mla_asm.csv) and finding the row a decode call
needs, checked against the emulator's own lookup, which follows asm_mla.cu."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from jackfield_rocm_aiter.manifest import KernelKey, decode_kernel_key, kernel_query_len, read_manifest
from jackfield_rocm_aiter.platform import manifest_path

from .aiter_emulator import FIXTURES, EmulatedAbort, EmulatedAiter


def fixture(arch: str):  # type: ignore[no-untyped-def]
    return read_manifest(manifest_path(FIXTURES, arch), arch)


def test_both_csv_formats_are_read() -> None:
    """gfx950's manifest has a cprr column, gfx942's has none (cprr 0)."""
    gfx942, gfx950 = fixture("gfx942"), fixture("gfx950")
    assert len(gfx942.kernels) == 14 and len(gfx950.kernels) == 21
    two_rows = KernelKey("fp8", "fp8", 16, 0, 2, 0, 1, 0)
    assert gfx942.kernels[two_rows] == "_ZN5aiter33mla_a8w8_qh16_qseqlen2_gqaratio16E"
    assert {key.cprr for key in gfx942.kernels} == {0}
    assert KernelKey("fp8", "fp8", 16, 1, 4, 0, 1, 0, cprr=1) in gfx950.kernels
    assert gfx950.kernels[KernelKey("fp8", "fp8", 16, 0, 4, 0, 0, 0)].endswith("qseqlen4_gqaratio16_msk0E")


@pytest.mark.parametrize(
    ("q_type", "heads", "lengths"),
    [
        ("bf16", 16, {1: 1, 2: 4, 3: 4, 4: 4, 5: 8, 8: 8}),
        ("fp8", 16, {1: 1, 2: 2, 3: 4, 4: 4, 5: None}),
        ("bf16", 128, {1: 0, 3: 0, 4: 0}),
        ("fp8", 128, {1: 0, 2: 0, 4: 0}),
    ],
)
def test_query_lengths_are_padded_as_aiter_pads_them(
    q_type: str, heads: int, lengths: dict[int, int | None]
) -> None:
    assert {q: kernel_query_len(q_type, q_type, heads, q) for q in lengths} == lengths


def test_one_query_row_asks_for_the_causal_kernel() -> None:
    """One row: the mask is a no-op and AITER looks up causal=1 either way."""
    one_row = decode_kernel_key("bf16", "bf16", 16, 1, causal=False)
    assert one_row == decode_kernel_key("bf16", "bf16", 16, 1, causal=True)
    assert decode_kernel_key("bf16", "bf16", 16, 2, causal=False).causal == 0  # type: ignore[union-attr]


def test_non_causal_decode_comes_from_the_manifest_not_a_list() -> None:
    """gfx942 has no non-causal multi-token decode; gfx950 has it over fp8 for 16 heads at 1, 3, 4
    rows (not 2) and for 128 heads at any length; neither has it over bf16."""
    gfx942, gfx950 = fixture("gfx942"), fixture("gfx950")

    def has(manifest, q_type: str, heads: int, q: int) -> bool:  # type: ignore[no-untyped-def]
        return manifest.missing_decode_kernel(q_type, q_type, heads, q, causal=False) is None

    assert [q for q in range(1, 5) if has(gfx942, "fp8", 16, q)] == [1]
    assert [q for q in range(1, 5) if has(gfx950, "fp8", 16, q)] == [1, 3, 4]
    assert [q for q in range(1, 5) if has(gfx950, "fp8", 128, q)] == [1, 2, 3, 4]
    assert [q for q in range(1, 5) if has(gfx950, "bf16", 16, q)] == [1]
    reason = gfx950.missing_decode_kernel("fp8", "fp8", 16, 2, causal=False)
    assert reason is not None and "gfx950" in reason and "qSeqLen=2" in reason and "causal=0" in reason
    too_long = gfx950.missing_decode_kernel("fp8", "fp8", 16, 5, causal=True)
    assert too_long is not None and "aborts before looking" in too_long


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_plugin_and_the_emulator_agree_on_every_decode_kernel(arch: str) -> None:
    """The plugin's lookup (manifest.py) and the emulator's (written after asm_mla.cu, separately)
    agree on which calls have a kernel, for every type, head count, length up to 8 and mask."""
    manifest, aiter = fixture(arch), EmulatedAiter(arch)
    calls = itertools.product(("bf16", "fp8"), (16, 128), range(1, 9), (True, False))
    for q_type, heads, q_len, causal in calls:
        dtype = aiter.fp8 if q_type == "fp8" else torch.bfloat16
        q, kv = torch.zeros(1, heads, 576, dtype=dtype), torch.zeros(1, 1, 1, 576, dtype=dtype)
        scale = torch.ones(1)
        try:
            aiter._kernel(q, kv, q_len, 1, causal, scale, scale)
            emulated = True
        except EmulatedAbort:
            emulated = False
        planned = manifest.missing_decode_kernel(q_type, q_type, heads, q_len, causal) is None
        assert planned == emulated, (arch, q_type, heads, q_len, causal)


def test_a_malformed_manifest_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "mla_asm.csv"
    path.write_text("qType,kvType,Gqa,ps,qSeqLen,prefill,causal,lse,knl_name,co_name\n"
                    "bf16,bf16,16,0,1,0,1,0,k1,k1.co\nbf16,bf16,sixteen,0,1,0,1,0,k2,k2.co\n")
    with pytest.raises(ValueError, match=r"mla_asm.csv, line 3"):
        read_manifest(path, "gfx942")
    path.write_text("qType,kvType,Gqa,ps,qSeqLen,prefill,knl_name\n")
    with pytest.raises(ValueError, match=r"no column \['causal', 'lse'\]"):
        read_manifest(path, "gfx942")
