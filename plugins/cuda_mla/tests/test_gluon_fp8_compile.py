"""The register-operand fp8 kernel (decode_gluon_fp8.py) compiled for sm_90 here (no GPU needed):
what its design rests on.

- every wgmma takes its A operand (keys for QK, transposed values for PV) from registers, none
  from shared memory, so no f16 copy of a tile is stored: 2 consumers x (36 + 32) HGMMA whose first
  source is a register;
- the keys arrive by 16-byte shared loads (a thread's 16 consecutive dims of a key), the transposed
  values by 4-byte loads (4 consecutive dims of a key, a quarter of the values at a time), both
  converted in registers (F2FP e4m3 -> f16; a value's bytes paired by key first) and relabelled
  into wgmma's A layout there (no shared-memory scratch): no byte or 16-bit loads of a tile; and
  each element of the A operand, by Triton's own layout, is the one the query's and the output's
  dimension orders (key_dims, value_dims) expect;
- QK keeps one group's wgmma in flight while the next group is loaded (wait 1, not wait 0);
- the ring of whole fp8 tiles, the f16 query and two P^T fit 227 KB; three partitions (two
  consumers, the producer warp at its register count).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton

hopper = pytest.importorskip(
    "triton.experimental.gluon.language.nvidia.hopper", reason="this Triton has no Gluon Hopper module"
)
from jackfield_cuda_mla.kernels import decode_gluon_fp8 as regs  # noqa: E402
from jackfield_cuda_mla.testing import sm90  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(sm90.CUOBJDUMP), reason="this Triton ships no cuobjdump")
RANK, ROPE, PAGE = sm90.RANK, sm90.ROPE, sm90.PAGE


def compile_sm90(block_m: int) -> tuple[str, int]:
    """(SASS, shared memory bytes) of the kernel as decode_gluon_fp8.launch_register_operands launches it."""
    constants = dict(RANK=RANK, ROPE=ROPE, BLOCK_M=block_m, PAGE=PAGE, CAUSAL=True)
    constants["SLOTS"] = regs.ring_tiles(RANK, ROPE, block_m)
    kernel = regs.mla_decode_fp8_register_operands
    return sm90.sm90_sass(kernel, True, constants, f"fp8_regs_{block_m}")


def counts(sass: str, shared: int, block_m: int) -> dict:
    got = sm90.count(sass, shared, block_m)
    got.update(
        register_a=len(re.findall(rf"\bHGMMA\.64x{block_m}x16\.F32 R\d+, R\d+, gdesc", sass)),
        key_loads=len(re.findall(r"\bLDS\.128\b", sass)),
        value_loads=len(re.findall(r"\bLDS R", sass)),  # 4-byte loads
        narrow_loads=len(re.findall(r"\bLDS\.(U8|U16|S8|S16)\b", sass)),
        conversions=len(re.findall(r"\bF2FP\.F16\.E4M3\.UNPACK_B\b", sass)),
    )
    return got


def wgmma_a_layouts() -> dict[str, dict[str, list[list[int]]]]:
    """wgmma's f16 A-operand layout (4 warps, 16 rows) as Triton defines it, as linear-layout bases:
    for a K chunk [64 keys, 64 dims] and a value quarter's V^T [128 dims, 64 keys]."""
    from triton._C.libtriton import gluon_ir

    context = ir.context()  # kept alive while the builder works
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    a_operand = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    layouts = {}
    for shape in ([64, 64], [128, 64]):
        linear = builder.to_linear_layout(a_operand._to_ir(builder), shape)
        bases = dict(reg=linear.reg_bases, lane=linear.lane_bases, warp=linear.warp_bases)
        layouts[f"{shape[0]}x{shape[1]}"] = bases
    return layouts


@functools.cache
def compiled() -> dict:
    """The compile's counts and Triton's A layouts, from a child process (Triton's bindings report
    leaked objects at exit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    with tempfile.TemporaryDirectory() as cache:
        # A fresh cache: Triton's key for a compile does not cover the layouts' values, and a kernel
        # compiled before a layout changed would be reported as this one.
        env["TRITON_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Spill instructions as compiled by the Triton releases the kernel was measured with (H200 timings:
# Triton 3.6), by rows a program; a rise means registers a tile's loop now spills.
SPILL_CEILING = {16: {(3, 6): 8, (3, 9): 8}, 32: {(3, 6): 100}}
RELEASE = tuple(int(part) for part in triton.__version__.split(".")[:2])


# The 32-row compile is pinned only under Triton 3.6, the release timed.
@pytest.mark.parametrize("block_m", [16, 32] if RELEASE == (3, 6) else [16])
def test_register_operand_kernel_reads_no_f16_tile_and_fits(block_m: int) -> None:
    got = compiled()["counts"][str(block_m)]
    assert got["hgmma"] == 2 * (36 + 32) and got["register_a"] == got["hgmma"], got
    assert got["mma_sync"] == 0 and got["tma"] > 0, got
    # A consumer's tile: 9 chunks x 2 key rows (+ 2 x 8 where a split's last tile zeroes its stale
    # keys); 2 consumers. A relabel through shared memory instead of registers would add loads of
    # its own (and scratch, below).
    assert 2 * (9 * 2 + 2 * 8) <= got["key_loads"] <= 2 * (9 * 2 + 2 * 8) + 8, got
    # 4 value quarters x 16 keys; 2 consumers (+ the softmax's and the merge's 4-byte reads)
    assert 2 * 4 * 16 <= got["value_loads"] <= 2 * 4 * 16 + 48, got
    assert got["narrow_loads"] <= 1, got  # the one: warp_specialize's own flag, not a tile
    assert got["conversions"] == 2 * (9 * 16 + 2 * 64), got  # two fp8 a conversion
    if block_m == 16:
        assert "wait1" in got["wgmma_order"], got  # QK: a group in flight while the next one loads
    else:  # ptxas serializes every wgmma of the 32-row kernel (as timed: RESULTS.md cuda_mla round 8)
        assert got["waits"] == got["hgmma"], got
    slots = regs.ring_tiles(RANK, ROPE, block_m)
    query, p_t, ring = block_m * (RANK + ROPE) * 2, 2 * 64 * block_m * 2, slots * 64 * (RANK + ROPE)
    buffers = query + p_t + ring + (3 * slots + 1) * 8  # + the mbarriers
    assert got["shared"] - buffers < 2048, got  # no scratch for a layout conversion (>= 3.5 KB)
    assert got["shared"] <= 227 * 1024, got
    assert hex(regs.PRODUCER_REGS.value) in got["regs_given_back"], got
    assert hex(regs.CONSUMER_REGS.value) in got["regs_taken"], got
    if RELEASE in SPILL_CEILING[block_m]:
        assert got["spills"] <= SPILL_CEILING[block_m][RELEASE], got


def _owners(bases: dict[str, list[list[int]]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(row, col) -> (lane, warp) holding it, for a linear layout's bases."""
    held = {}
    for reg, lane, warp in itertools.product(
        range(1 << len(bases["reg"])), range(1 << len(bases["lane"])), range(1 << len(bases["warp"]))
    ):
        row = col = 0
        for level, index in (("reg", reg), ("lane", lane), ("warp", warp)):
            for bit, (dr, dc) in enumerate(bases[level]):
                if index >> bit & 1:
                    row, col = row ^ dr, col ^ dc
        held[(row, col)] = (lane, warp)
    return held


def _bases(layout: gl.DistributedLinearLayout) -> dict[str, list[list[int]]]:
    return dict(reg=layout.reg_bases, lane=layout.lane_bases, warp=layout.warp_bases)


def test_operand_loads_hold_what_wgmma_reads_in_the_dimension_orders() -> None:
    """Each element of wgmma's A operand (Triton's layout) is held by the thread that loaded it
    (the relabel is register-only), and it is the element the query's order (key_dims) and the
    output's order (value_dims) say: the keys' element (key, k) is cache dim key_dims(k); V^T's
    row m is output column value_dims(m). The kernel's reshape/permute are mirrored here."""
    key_dims, value_dims = regs.key_dims.fn, regs.value_dims.fn
    assert sorted(map(key_dims, range(RANK + ROPE))) == list(range(RANK + ROPE))
    assert all(key_dims(k) // 64 == k // 64 for k in range(RANK + ROPE))  # within each chunk
    assert sorted(map(value_dims, range(RANK // 2))) == list(range(RANK // 2))

    dims = torch.arange(64)
    relabelled = dims.reshape(4, 4, 2, 2).permute(1, 2, 0, 3).reshape(64)  # _key_chunk, per key
    assert relabelled.tolist() == [key_dims(k) for k in range(64)]
    dims = torch.arange(128)
    relabelled = dims.reshape(4, 8, 2, 2).permute(2, 0, 3, 1).reshape(128)  # _values_t, per key
    assert relabelled.tolist() == [value_dims(m) for m in range(128)]
    assert all(value_dims(m + 128) == value_dims(m) + 128 for m in range(128))  # the second quarter

    wgmma = compiled()["a_layouts"]
    loaded, wanted = _owners(_bases(regs.KEY_CHUNK_LOAD)), _owners(wgmma["64x64"])
    assert len(loaded) == len(wanted) == 64 * 64
    assert all(loaded[(key, key_dims(k))] == thread for (key, k), thread in wanted.items())
    loaded, wanted = _owners(_bases(regs.VALUES_T_LOAD)), _owners(wgmma["128x64"])
    assert len(loaded) == len(wanted) == 128 * 64
    assert all(loaded[(value_dims(m), key)] == thread for (m, key), thread in wanted.items())


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 in its default mode: byte i of the result is byte (selector >> 4i) & 7 of b:a."""
    pool = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[selector >> 4 * i & 7] for i in range(4)), "little")


def test_value_bytes_paired_by_key_come_back_where_the_relabel_expects() -> None:
    """_values_t hands each 8 of a thread's loaded value bytes (dims d .. d + 3 of keys k, k + 1;
    Triton packs them low byte first into two words) to KEY_PAIRS_TO_F16, whose byte permutes
    (emulated here by the PTX rule) pair them by key before the conversions (each 16 bits -> an f16
    pair, low byte first); the permute that follows must undo that order exactly: V^T as the
    relabel then sees it is V^T as loaded."""
    asm = regs.KEY_PAIRS_TO_F16.value
    selectors = [int(x, 16) for x in re.findall(r"prmt\.b32 \w+, \$4, \$5, (0x[0-9a-f]+);", asm)]
    assert len(selectors) == 2 and asm.count("cvt.rn.f16x2.e4m3x2") == 4
    words = [int.from_bytes(bytes(range(4 * w, 4 * w + 4)), "little") for w in (0, 1)]
    returned = [_prmt(*words, selector) >> 8 * i & 0xFF for selector in selectors for i in range(4)]
    assert sorted(returned) == list(range(8))

    bases = _bases(regs.VALUES_T_LOAD)
    loaded = torch.arange(128 * 64).reshape(128, 64)  # each element's own (dim, key), flattened
    after_asm = torch.empty_like(loaded)
    for lane, warp in itertools.product(range(32), range(4)):
        held = []  # this thread's elements in register order
        for reg in range(1 << len(bases["reg"])):
            row = col = 0
            for level, index in (("reg", reg), ("lane", lane), ("warp", warp)):
                for bit, (dr, dc) in enumerate(bases[level]):
                    if index >> bit & 1:
                        row, col = row ^ dr, col ^ dc
            held.append((row, col))
        for group in range(0, len(held), 8):
            for out, source in enumerate(returned):
                after_asm[held[group + out]] = loaded[held[group + source]]
    undone = after_asm.reshape(4, 8, 2, 2, 32, 2).permute(0, 1, 5, 2, 4, 3).reshape(128, 64)
    assert torch.equal(undone, loaded)


def test_ring_holds_five_whole_fp8_tiles() -> None:
    """16 rows: the f16 query (18 KB) and two P^T (4 KB) leave room for five 36 KB tiles; 32 rows
    (36 + 8 KB) too, with 3 KB to spare."""
    assert regs.ring_tiles(RANK, ROPE, 16) == regs.ring_tiles(RANK, ROPE, 32) == 5
    assert [regs.block_rows(rows) for rows in (1, 8, 16, 17, 32)] == [16, 16, 16, 32, 32]


if __name__ == "__main__":
    compiled_counts = {str(block_m): counts(*compile_sm90(block_m), block_m) for block_m in (16, 32)}
    print(json.dumps(dict(counts=compiled_counts, a_layouts=wgmma_a_layouts())))
