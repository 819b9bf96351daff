"""The Gluon many-rows decode kernel (Hopper, heads a multiple of 64) at full DeepSeek shapes.

Every case checks that the call really launches the Gluon kernel (or, for 96 heads, not), poisons the
outputs and every cache row at or past a request's seq_len (the partial last page and the unused
pages) with NaN, and compares with the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from jackfield_cuda_mla.kernels import decode, mla_decode
from jackfield_cuda_mla.kernels.decode import DecodeConfig, default_config
from jackfield_cuda_mla.testing import decode_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(decode.decode_gluon_many is None, reason="this Triton has no usable Gluon"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
        reason="the Gluon kernel is Hopper-only (compute capability 9.x)",
    ),
]
RANK, ROPE, PAGE, HEADS = 512, 64, 64, 128
SEQ_LENS = [0, 1, 63, 64, 65, 4096 + 17]
Q_LENS = {"q1": [1] * 6, "q2": [2] * 6, "mixed up to 8": [1, 8, 2, 3, 2, 1]}


def poisoned_batch(seq_lens: list[int], q_lens: list[int], heads: int, dtype: torch.dtype) -> dict:
    """Random pages; every slot at or past a request's seq_len (in its own pages) holds NaN."""
    pages_per_req = max(seq_lens) // PAGE + 2  # at least one wholly unused page a request
    num_blocks = len(seq_lens) * pages_per_req
    cache = torch.randn(num_blocks, PAGE, RANK + ROPE).to(dtype)
    block_table = torch.randperm(num_blocks, dtype=torch.int32).reshape(len(seq_lens), pages_per_req)
    position = torch.arange(pages_per_req * PAGE).reshape(pages_per_req, PAGE)
    for req, seq_len in enumerate(seq_lens):
        past_end = position >= seq_len
        for slot, page in enumerate(block_table[req].tolist()):
            cache[page][past_end[slot]] = float("nan")
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        query=torch.randn(int(qsl[-1]), heads, RANK + ROPE).to(dtype),
        kv_cache=cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
    )


@pytest.fixture
def gluon_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts launches of the Gluon kernel (so a test knows which kernel it checked)."""
    launches: list[int] = []
    launch = decode.decode_gluon_many.launch_many_rows

    def counted(*args, **kwargs) -> None:
        launches.append(1)
        launch(*args, **kwargs)

    monkeypatch.setattr(decode.decode_gluon_many, "launch_many_rows", counted)
    return launches


def assert_matches_reference(batch: dict, causal: bool, config: DecodeConfig, splits: int | None) -> None:
    gpu = {k: v.cuda() for k, v in batch.items()}
    tokens, heads, _ = batch["query"].shape
    out = torch.full((tokens, heads, RANK), float("nan"), device="cuda", dtype=batch["query"].dtype)
    lse = torch.full((tokens, heads), float("nan"), device="cuda")
    mla_decode(
        gpu["query"],
        gpu["kv_cache"],
        gpu["block_table"],
        gpu["seq_lens"],
        gpu["query_start_loc"],
        max_query_len=int(batch["query_start_loc"].diff().max()),
        max_seq_len=int(batch["seq_lens"].max()),
        sm_scale=(RANK + ROPE) ** -0.5,
        kv_lora_rank=RANK,
        causal=causal,
        num_splits=splits,
        config=config,
        out=out,
        lse=lse,
    )
    ref_out, ref_lse = decode_reference(batch, (RANK + ROPE) ** -0.5, RANK, causal=causal)
    out, lse = out.cpu().double(), lse.cpu().double()
    assert not out.isnan().any()
    # Per row: a long request's outputs are averages far smaller than a one-key row's
    row_err = (out - ref_out).abs().amax(-1)
    assert (row_err <= 1e-2 * ref_out.abs().amax(-1) + 2e-3).all(), row_err.max().item()
    seen = ref_lse.isfinite()
    assert not seen.all(), "the batch must hold rows that see no key"
    assert torch.equal(lse.isfinite(), seen)
    assert (lse[~seen] == float("-inf")).all()
    assert (out[~seen] == 0).all()
    assert (lse[seen] - ref_lse[seen]).abs().max().item() < 2e-3


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("q_case", sorted(Q_LENS))
@pytest.mark.parametrize("causal", [True, False])
def test_default_tile_matches_reference(
    causal: bool, q_case: str, splits: int | None, gluon_launches: list[int]
) -> None:
    config = default_config(HEADS, on_gpu=True)
    assert config.gluon
    assert_matches_reference(
        poisoned_batch(SEQ_LENS, Q_LENS[q_case], HEADS, torch.bfloat16), causal, config, splits
    )
    assert len(gluon_launches) == 1


@pytest.mark.parametrize("tile", [(32, 4), (32, 3)])
def test_other_tiles_match_reference(tile: tuple[int, int], gluon_launches: list[int]) -> None:
    config = DecodeConfig(64, tile[0], 8, tile[1], tma=True, gluon=True)
    assert_matches_reference(
        poisoned_batch(SEQ_LENS, Q_LENS["mixed up to 8"], HEADS, torch.bfloat16), True, config, None
    )
    assert len(gluon_launches) == 1


def test_fp16_and_64_heads(gluon_launches: list[int]) -> None:
    config = default_config(64, on_gpu=True, cache_dtype=torch.float16)
    assert_matches_reference(poisoned_batch(SEQ_LENS, Q_LENS["q2"], 64, torch.float16), True, config, None)
    assert len(gluon_launches) == 1


def test_heads_not_a_multiple_of_64_take_the_triton_kernel(gluon_launches: list[int]) -> None:
    """96 heads: a 64-row block would mix tokens, so the call falls back (and still matches)."""
    config = default_config(96, on_gpu=True)
    batch = poisoned_batch([0, 65, 700], [1, 2, 1], 96, torch.bfloat16)
    assert_matches_reference(batch, True, config, None)
    assert gluon_launches == []
