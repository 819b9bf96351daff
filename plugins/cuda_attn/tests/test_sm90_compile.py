"""The attention kernels compiled for sm_90 here (no GPU needed): what their speed rests on.

At the main shape (GQA 32/8, D 128, bf16, block 64), as the launches specialize them (strides
multiples of 16): the KV tiles are copied asynchronously (cp.async, LDGSTS: vectorized and
pipelined; scalar loads would cap decode far below the copy bandwidth), the prefill's products
run on wgmma (HGMMA), nothing spills to local memory, and shared memory fits a Hopper program.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import triton

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
pytestmark = pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")


def compile_sm90(role: str) -> dict:
    """SASS counts of the decode or prefill kernel (runs in a fresh process: see compiled)."""
    from jackfield_cuda_attn.kernels import attention
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", block_table="*i32", seq_lens="*i32",
                 query_start="*i32", sinks="*fp32", kv_scale="*fp32", out="*bf16", lse="*fp32")  # fmt: skip
    common = dict(NUM_HEADS=32, GROUP=4, NUM_CHUNKS=1, D=128, BS=64, CAUSAL=True, HAS_WINDOW=True,
                  HAS_SINKS=True, FP8=False)  # fmt: skip
    if role == "decode":
        kernel = attention._decode_kernel
        types.update(part_out="*fp32", part_lse="*fp32", qk_scale="fp32", window="i32", num_splits="i32")
        strides = ["stride_qt", "stride_qh", "stride_ot", "stride_bt", "stride_slot"]
        strides += ["stride_split_out", "stride_split_lse"]
        constants = dict(common, HEADS=4, BLOCK_M=16, BLOCK_N=64, SPLIT=True)
        options = dict(num_warps=4, num_stages=3)
    else:
        kernel = attention._prefill_kernel
        types.update(qk_scale="fp32", window="i32", num_reqs="i32")
        strides = ["stride_qt", "stride_qh", "stride_ot", "stride_bt", "stride_slot"]
        block_m, block_n, num_warps, num_stages = attention._prefill_tiles(128)
        constants = dict(common, HEADS=4, BLOCK_M=block_m, BLOCK_Q=block_m // 4, BLOCK_N=block_n)
        options = dict(num_warps=num_warps, num_stages=num_stages)
    types.update({name: "i32" for name in strides})
    names = kernel.arg_names  # the positions the constants and attributes are keyed by
    aligned = [n for n, t in types.items() if t.startswith("*") or n in strides]
    given = dict(types, **{name: "constexpr" for name in constants})
    signature = {name: given[name] for name in names}
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()},
                       {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    cubin = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"cuda_attn_{role}_{os.getpid()}.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    finally:
        os.remove(cubin)
    return dict(
        async_copies=len(re.findall(r"\bLDGSTS\b", sass)),
        wgmma=len(re.findall(r"\bHGMMA\.", sass)),
        spills=len(re.findall(r"\b(LDL|STL)\b", sass)),
        shared=compiled.metadata.shared,
    )


def compiled(role: str) -> dict:
    """Compiled in a fresh process: interpreter tests (TRITON_INTERPRET=1) patch Triton's language
    in-process, which breaks a real compile afterwards."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, __file__, role], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_kv_tiles_are_copied_asynchronously_without_spills(role: str) -> None:
    got = compiled(role)
    assert got["async_copies"] > 0, f"{role}: KV tiles are not loaded by cp.async: {got}"
    assert got["spills"] == 0, f"{role}: registers spill: {got}"
    assert got["shared"] <= 227 * 1024, got
    if role == "prefill":
        assert got["wgmma"] > 0, f"prefill's products do not run on wgmma: {got}"


if __name__ == "__main__":
    print(json.dumps(compile_sm90(sys.argv[1])))
