"""Compiles the Gluon many-rows decode kernel for sm_90 (no GPU needed) and checks its machine code.

What the kernel's speed rests on: wgmma (HGMMA), a wait that leaves the other product in flight,
no local-memory spills of the accumulator, and shared memory within the H100/H200's 227 KB a block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

gluon_many = pytest.importorskip(
    "jackfield_cuda_mla.kernels.decode_gluon_many", reason="this Triton lacks Gluon's Hopper modules"
)
from jackfield_cuda_mla.kernels.decode import default_config  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHARED_LIMIT = 227 * 1024


def descriptor_type(rows: int, cols: int) -> str:
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {cols}],{layout!r}>"


def compile_default_tile(out_dir: Path) -> None:
    """Writes the sm_90 cubin, its SASS, its resource use and its shared-memory size into out_dir."""
    config = default_config(128, on_gpu=True)
    block_n, stages = config.block_n, config.num_stages
    signature = {
        "q_nope_desc": descriptor_type(64, 512),
        "q_pe_desc": descriptor_type(64, 64),
        "kv_desc": descriptor_type(block_n, 512),
        "pe_desc": descriptor_type(block_n, 64),
        "block_table": "*i32",
        "seq_lens": "*i32",
        "query_start_loc": "*i32",
        "out": "*bf16",
        "lse": "*fp32",
        "sm_scale_log2": "fp32",
        **{name: "i32" for name in ("num_heads", "stride_bt", "stride_ot", "stride_oh", "stride_os")},
        **{name: "i32" for name in ("stride_lt", "stride_lh", "stride_ls", "num_splits")},
    }
    constants = dict(
        RANK=512,
        ROPE=64,
        BLOCK_N=block_n,
        STAGES=stages,
        PAGE=64,
        CAUSAL=True,
    )
    signature.update({name: "constexpr" for name in constants})
    source = GluonASTSource(gluon_many.mla_decode_many_rows, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    cubin = out_dir / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    for flag, name in (("-sass", "kernel.sass"), ("-res-usage", "resources")):
        dump = subprocess.run(
            [str(BIN / "cuobjdump"), flag, str(cubin)], capture_output=True, text=True, check=True
        )
        (out_dir / name).write_text(dump.stdout)
    (out_dir / "shared").write_text(str(kernel.metadata.shared))


@pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="Triton ships no ptxas/cuobjdump here",
)
def test_default_tile_compiles_to_overlapped_wgmma_without_spills(tmp_path: Path) -> None:
    # A child process: the repo's conftest turns on TRITON_INTERPRET without a GPU, and the
    # interpreter's functions cannot be compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    subprocess.run([sys.executable, __file__, str(tmp_path)], check=True, env=env, timeout=120)
    sass = (tmp_path / "kernel.sass").read_text()
    stack = int(re.search(r"STACK:(\d+)", (tmp_path / "resources").read_text()).group(1))

    assert int((tmp_path / "shared").read_text()) <= SHARED_LIMIT
    assert re.search(r"\bHGMMA\.64x256x16\.F32\.BF16\b", sass), "PV must run on wgmma (64 x 256 a warpgroup)"
    assert re.search(r"\bHGMMA\.64x(16|32)x16\.F32\.BF16\b", sass), "QK must run on wgmma"
    assert not re.search(r"\bHMMA\b", sass), "no mma.sync fallback"
    # PV(t - 1) is waited for while QK(t)'s two wgmma groups run on (the buffer refill overlaps QK)
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x2", sass), "PV's wait must leave QK in flight"
    # Triton 3.6 spills a few loop scalars (24-32 bytes); the accumulator alone is 512 bytes a thread
    assert stack <= 64, f"{stack} bytes of local memory a thread: more than scalars spill"


def test_shapes_the_kernel_takes_and_leaves_to_triton() -> None:
    """Fail closed: tiles whose Q + ring exceed 227 KB of shared memory, or untested shapes, fall back."""
    query = torch.randn(2, 128, 576, dtype=torch.bfloat16)
    cache = torch.randn(4, 64, 576, dtype=torch.bfloat16)
    fits = gluon_many.many_rows_shapes_fit
    assert (
        fits(query, cache, 512, 64, 2) and fits(query, cache, 512, 32, 4) and fits(query, cache, 512, 32, 3)
    )
    assert fits(query.half(), cache.half(), 512, 64, 2)
    assert not fits(query, cache, 512, 64, 3)  # Q 73.7 KB + 3 x 73.7 KB pages
    assert not fits(query, cache, 512, 32, 5)
    wide_rope = torch.randn(2, 128, 640, dtype=torch.bfloat16)
    assert not fits(wide_rope, torch.randn(4, 64, 640, dtype=torch.bfloat16), 512, 64, 2)
    assert not fits(torch.randn(2, 96, 576, dtype=torch.bfloat16), cache, 512, 64, 2)  # 64 rows mix tokens
    assert not fits(query, cache.to(torch.float8_e4m3fn), 512, 64, 2)
    assert not fits(query.float(), cache.float(), 512, 64, 2)
    assert not fits(query, cache, 512, 16, 2)  # untested tile
    assert not fits(query, torch.randn(4, 65, 576, dtype=torch.bfloat16)[:, :64], 512, 64, 2)  # pages apart
    assert not fits(query.transpose(0, 1).contiguous().transpose(0, 1), cache, 512, 64, 2)  # Q not one matrix


if __name__ == "__main__":
    compile_default_tile(Path(sys.argv[1]))
