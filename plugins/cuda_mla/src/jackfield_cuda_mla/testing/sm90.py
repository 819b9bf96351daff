"""Compiling cuda_mla's Gluon decode kernels for sm_90 without a GPU, and reading their SASS.

Needs a Triton with Gluon's Hopper modules and the cuobjdump it ships (`CUOBJDUMP`); the compile
tests skip without them.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

from jackfield_cuda_mla.kernels import decode_gluon_few as few

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
RANK, ROPE, PAGE = 512, 64, 64  # DeepSeek's widths, the page the kernels are timed with
SCALARS = ["num_heads", "stride_qt", "stride_qh", "stride_bt", "stride_ot", "stride_oh", "stride_os"]
SCALARS += ["stride_lt", "stride_lh", "stride_ls"]


def sm90_sass(kernel, fp8: bool, constants: dict, tag: str) -> tuple[str, int]:
    """(SASS, shared memory bytes) of a few-rows decode kernel (the launch arguments
    few_rows_arguments makes; fp8: a kv_scale after them) compiled for sm_90 with these constants."""
    dtype = gl.float8e4nv if fp8 else gl.bfloat16
    cache = torch.empty(4, PAGE, RANK + ROPE, dtype=few.FP8 if fp8 else torch.bfloat16)

    def descriptor(box: list[int]) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
        return TensorDescriptor(cache, [4 * PAGE, RANK + ROPE], [RANK + ROPE, 1], box, layout)

    signature = {
        "q": "*bf16",
        "nope_desc": mangle_type(descriptor([64, RANK // 2])),
        "rope_desc": mangle_type(descriptor([64, ROPE])),
        "block_table": "*i32",
        "seq_lens": "*i32",
        "query_start_loc": "*i32",
        "out": "*bf16",
        "lse": "*fp32",
        "sm_scale_log2": "fp32",
        **{name: "i32" for name in SCALARS},
        **({"kv_scale": "*fp32"} if fp8 else {}),
        "num_splits": "i32",
    }
    names = list(signature) + list(constants)
    signature.update({name: "constexpr" for name in constants})
    aligned = [name for name in ("q", "block_table", "seq_lens", "query_start_loc", "out", "lse", "kv_scale")]
    source = GluonASTSource(
        kernel,
        signature,
        {(names.index(name),): value for name, value in constants.items()},
        {(names.index(name),): [["tt.divisibility", 16]] for name in aligned if name in names},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=few.NUM_WARPS))
    cubin = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gluon_{tag}_{os.getpid()}.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    finally:
        os.remove(cubin)
    return sass, compiled.metadata.shared


def wgmma_order(sass: str) -> str:
    """The wgmma and their waits in program order: a run of QK wgmma (K operand as stored) as
    `QK<n>`, of PV wgmma (V^T: transposed A) as `PV<n>`, a wait for at most k groups in flight as
    `wait<k>`; e.g. "QK36 wait0 PV32 wait0"."""
    events = []
    for line in sass.splitlines():
        if re.search(r"\bHGMMA\.", line):
            events.append("PV" if ".tnspA" in line else "QK")
        elif wait := re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", line):
            events.append(f"wait{int(wait.group(1), 16)}")
    runs = [(event, len(list(group))) for event, group in itertools.groupby(events)]
    return " ".join(event if event.startswith("wait") else f"{event}{n}" for event, n in runs)


def count(sass: str, shared: int, block_m: int) -> dict:
    return dict(
        hgmma=len(re.findall(rf"\bHGMMA\.64x{block_m}x16\.F32(\.BF16)? ", sass)),  # bf16 or f16 operands
        waits=len(re.findall(r"WARPGROUP\.DEPBAR", sass)),
        wgmma_order=wgmma_order(sass),
        mma_sync=len(re.findall(r"\bHMMA\b", sass)),
        spills=len(re.findall(r"\b(LDL|STL)\b", sass)),
        tma=len(re.findall(r"\bUTMALDG\b", sass)),
        shared=shared,
        # warp specialization: a worker warpgroup gives registers back (setmaxnreg.dec), the
        # default one takes them (setmaxnreg.inc), and each syncs on its own 128-thread barrier
        regs_given_back=sorted(set(re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass))),
        regs_taken=sorted(set(re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)", sass))),
        warpgroup_barriers=sorted(set(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+), 0x80 ", sass))),
    )
