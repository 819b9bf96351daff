"""The Gluon few-rows decode kernel compiled for sm_90 here (no GPU needed): what its speed rests on.

- wgmma (HGMMA), not mma.sync, and not serialized: ptxas puts a wait after every wgmma when an
  accumulator register may be written while one is in flight (a few waits per tile are expected:
  QK, then each PV half);
- no local-memory spills at 16 rows (the H=16, q_len 1 case), where 40 hoisted wgmma descriptors
  once spilled;
- TMA loads (UTMALDG), the shared-memory plan within the 227 KB a Hopper program may use.
The fp8 cache's kernel (decode_gluon_fp8.py) has its own compile test; both compile and count
through jackfield_cuda_mla.testing.sm90.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

hopper = pytest.importorskip(
    "triton.experimental.gluon.language.nvidia.hopper", reason="this Triton has no Gluon Hopper module"
)
from jackfield_cuda_mla.kernels import decode_gluon_few as few  # noqa: E402
from jackfield_cuda_mla.testing.sm90 import CUOBJDUMP, PAGE, RANK, ROPE, count, sm90_sass  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")


def compile_sm90(block_m: int) -> tuple[str, int]:
    """(SASS, shared memory bytes) of the bf16 kernel as decode.py launches it."""
    nope_slots, rope_slots = few.ring_slots(block_m, RANK, ROPE)
    constants = dict(RANK=RANK, ROPE=ROPE, BLOCK_M=block_m, PAGE=PAGE, CAUSAL=True)
    constants.update(NOPE_SLOTS=nope_slots, ROPE_SLOTS=rope_slots)
    return sm90_sass(few.mla_decode_few_rows, False, constants, f"few_{block_m}")


def compiled_counts(block_m: int) -> dict:
    """SASS counts, compiled in a fresh process: interpreter tests (TRITON_INTERPRET=1) patch
    Triton's language in-process, which breaks a real compile afterwards."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, __file__, str(block_m)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block_m", [16, 32])
def test_bf16_kernel_uses_unserialized_wgmma_and_no_spills(block_m: int) -> None:
    """16 rows (H=16, q_len 1) and 32 (q_len 2): QK 576 / 16 k-steps, PV 2 halves x 4 M-blocks of
    64 x 4 k-steps, all wgmma, a few waits a tile, no spills, within 227 KB of shared memory."""
    got = compiled_counts(block_m)
    assert got["hgmma"] == 36 + 32 and got["waits"] <= 8, f"wgmma serialized: {got}"
    assert got["mma_sync"] == 0 and got["tma"] > 0, got
    assert got["spills"] == 0 or block_m == 32, got  # 32 rows: twice the accumulator, a few tolerated
    assert got["shared"] <= 227 * 1024, got


def test_ring_plan() -> None:
    """Value halves: 5 at 16 and 32 rows; a rope slot for every tile the ring can hold."""
    assert few.ring_slots(16, RANK, ROPE) == (5, 3)
    assert few.ring_slots(32, RANK, ROPE) == (5, 3)


def test_shapes_the_gluon_kernel_takes_and_leaves_to_triton() -> None:
    """Fail closed: anything but the tested shapes and layouts goes to the Triton kernel."""
    query = torch.randn(2, 16, RANK + ROPE).bfloat16()
    cache = torch.randn(8, PAGE, RANK + ROPE).bfloat16()
    fits = few.few_rows_shapes_fit
    assert fits(query, cache, 16, RANK) and fits(query, cache.to(few.FP8), 32, RANK)
    assert fits(query, torch.randn(4, 2 * PAGE, RANK + ROPE).bfloat16(), 16, RANK)
    assert not fits(query, cache, 33, RANK)  # more rows than one wgmma N of 32
    assert not fits(query.half(), cache.half(), 16, RANK)
    assert not fits(query.float(), cache.to(few.FP8), 16, RANK)
    assert not fits(query, cache, 16, RANK // 2)  # other widths
    assert not fits(query[..., :544], cache[..., :544], 16, RANK)
    assert not fits(query, torch.randn(8, 32, RANK + ROPE).bfloat16(), 16, RANK)  # half-tile pages
    padded = torch.randn(8, PAGE + 1, RANK + ROPE).bfloat16()[:, :PAGE]
    assert not fits(query, padded, 16, RANK)  # pages not back to back


class RecordedLaunch:
    """Stands in for a Gluon kernel's launcher: records the grid and the arguments of a launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, tuple, dict]] = []

    def __call__(self, grid: tuple, *args, **kwargs) -> None:
        self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("heads", [16, 32])
def test_launcher_plans_rows_and_ring(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 call goes to the kernel with wgmma N of 16 or 32 rows and the ring that fits."""
    kernel = RecordedLaunch()
    monkeypatch.setattr(few, "_launch", kernel)
    query = torch.randn(3, heads, RANK + ROPE).bfloat16()
    cache = torch.randn(8, PAGE, RANK + ROPE).bfloat16()
    out, lse = torch.empty(3, heads, RANK).bfloat16(), torch.empty(3, heads)
    i32 = torch.zeros(4, dtype=torch.int32)
    table, lengths = i32.view(2, 2), i32[:3]
    few.launch_few_rows(query, cache, table, lengths, lengths, out, lse, 0, 0, 0.1, heads, 2, True, RANK)
    ((grid, args, constants),) = kernel.launches
    block_m = 16 if heads == 16 else 32
    assert grid == (3, 2) and constants["BLOCK_M"] == block_m and constants["num_splits"] == 2
    assert (constants["NOPE_SLOTS"], constants["ROPE_SLOTS"]) == few.ring_slots(block_m, RANK, ROPE)
    assert args[0] is query and args[6] is out and args[7] is lse


if __name__ == "__main__":
    block_m_arg = int(sys.argv[1])
    print(json.dumps(count(*compile_sm90(block_m_arg), block_m_arg)))
