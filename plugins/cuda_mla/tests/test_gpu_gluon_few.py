"""The Gluon few-rows decode kernels at full DeepSeek widths on a Hopper GPU: decode_gluon_few.py
(bf16 caches) and decode_gluon_fp8.py (fp8 caches, <= 32 rows).

Every case checks against the float64 reference with NaN everywhere the kernel must not read or
leave: the output before the run, cache rows past each seq_len, pages no request uses.
"""

from __future__ import annotations

import pytest
import torch
from jackfield_cuda_mla.kernels import decode, mla_decode
from jackfield_cuda_mla.testing import decode_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(decode.decode_gluon_few is None, reason="this Triton has no usable Gluon"),
]
RANK, ROPE, PAGE, HEADS = 512, 64, 64, 16
FP8 = torch.float8_e4m3fn
SEQ_LENS = [0, 1, 63, 64, 65, 4096 + 17, 700]


def poisoned_batch(seq_lens: list[int], q_len: int, fp8: bool, heads: int = HEADS) -> dict:
    """Pages shuffled over a pool twice the needed size; NaN past each seq_len and in unused pages."""
    pages_per_req = max(seq_lens) // PAGE + 2
    num_blocks = 2 * len(seq_lens) * pages_per_req
    values = torch.randn(num_blocks, PAGE, RANK + ROPE, device="cuda")
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[: len(seq_lens) * pages_per_req]
    table = table.reshape(len(seq_lens), pages_per_req)
    poison = torch.ones(num_blocks * PAGE, dtype=torch.bool, device="cuda")
    for req, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len, device="cuda")
        poison[table[req, pos // PAGE].long() * PAGE + pos % PAGE] = False
    values.view(-1, RANK + ROPE)[poison] = float("nan")
    scale = torch.tensor([0.03], device="cuda") if fp8 else None
    cache = (values / scale).clamp(-448, 448).to(FP8) if fp8 else values.bfloat16()
    tokens = q_len * len(seq_lens)
    return dict(
        query=torch.randn(tokens, heads, RANK + ROPE, device="cuda", dtype=torch.bfloat16),
        kv_cache=cache,
        kv_scale=scale,
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device="cuda"),
        q_len=q_len,
    )


def run_and_check(batch: dict, causal: bool, num_splits: int | None = None) -> None:
    tokens, heads, _ = batch["query"].shape
    out, lse = mla_decode(
        batch["query"],
        batch["kv_cache"],
        batch["block_table"],
        batch["seq_lens"],
        batch["query_start_loc"],
        max_query_len=batch["q_len"],
        max_seq_len=int(batch["seq_lens"].max()),
        sm_scale=(RANK + ROPE) ** -0.5,
        kv_lora_rank=RANK,
        causal=causal,
        kv_scale=batch["kv_scale"],
        num_splits=num_splits,
        out=torch.full((tokens, heads, RANK), float("nan"), device="cuda", dtype=torch.bfloat16),
        lse=torch.full((tokens, heads), float("nan"), device="cuda"),
    )
    ref_out, ref_lse = decode_reference(batch, (RANK + ROPE) ** -0.5, RANK, causal=causal)
    assert not out.isnan().any() and not lse.isnan().any()
    # Per row: a long request's outputs are averages far smaller than a one-key row's
    row_err = (out.cpu().double() - ref_out).abs().amax(-1)
    assert (row_err <= 1e-2 * ref_out.abs().amax(-1) + 2e-3).all(), row_err.max().item()
    finite = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), finite)
    assert torch.equal(lse.cpu()[~finite], ref_lse[~finite].float())  # exactly -inf
    assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    assert torch.equal(out.cpu()[~finite], torch.zeros_like(out.cpu()[~finite]))  # exactly 0


@pytest.fixture
def gluon_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names the Gluon kernel each launch went to (so a test knows which kernel it checked):
    "few rows" (bf16) or "fp8 registers" (fp8)."""
    launches: list[str] = []
    targets = [(decode.decode_gluon_few, "launch_few_rows", "few rows")]
    if decode.decode_gluon_fp8 is not None:
        targets.append((decode.decode_gluon_fp8, "launch_register_operands", "fp8 registers"))
    for module, name, label in targets:
        launch = getattr(module, name)

        def counted(*args, launch=launch, label=label, **kwargs) -> None:
            launches.append(label)
            launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return launches


def hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


def expected_kernel(fp8: bool, rows: int) -> list[str]:
    """The launches a call must make: none off Hopper; fp8 caches (<= 32 rows) on the
    register-operand kernel, bf16 on the few-rows launcher."""
    if not hopper():
        return []
    assert rows <= 32
    return ["fp8 registers" if fp8 else "few rows"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_gluon_few_rows_matches_reference(
    fp8: bool, q_len: int, causal: bool, num_splits: int | None, gluon_launches: list[str]
) -> None:
    run_and_check(poisoned_batch(SEQ_LENS, q_len, fp8), causal, num_splits)
    assert gluon_launches == expected_kernel(fp8, HEADS * q_len)


@pytest.mark.parametrize("fp8", [False, True])
def test_single_tile_and_empty_requests(fp8: bool, gluon_launches: list[str]) -> None:
    """Splits that get no key (seq_len 0, short requests over many splits) give 0 / -inf partials;
    requests of exactly one tile (64) and of one partial tile (5)."""
    run_and_check(poisoned_batch([0, 5, 64, 0], 1, fp8), causal=True, num_splits=4)
    assert gluon_launches == expected_kernel(fp8, HEADS)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_len", [1, 2])
def test_tile_counts_around_the_consumer_alternation(
    fp8: bool, q_len: int, gluon_launches: list[str]
) -> None:
    """0-12 tiles, whole and partial last tiles, in one split: the fp8 kernels alternate tiles
    between two consumers (16 rows: over a ring of 5 tiles, so a slot's tiles alternate consumers;
    32 rows: over two f16 tiles), so every tile count ends each consumer's loop on another
    handshake phase and ring slot and leaves the merge another share of the tiles."""
    seq_lens = [0, 1, 64, 128, 130, 192, 255, 256, 257, 320, 384, 448, 512, 576, 640, 700, 768]
    run_and_check(poisoned_batch(seq_lens, q_len, fp8), causal=True, num_splits=1)
    assert gluon_launches == expected_kernel(fp8, HEADS * q_len)


def test_fp8_sixteen_rows_from_two_tokens(gluon_launches: list[str]) -> None:
    """8 heads x q_len 2: 16 rows of two tokens on the register-operand kernel, each token's causal
    limit its own."""
    run_and_check(poisoned_batch(SEQ_LENS, 2, fp8=True, heads=8), causal=True)
    assert gluon_launches == expected_kernel(True, 16)


def test_more_rows_than_the_kernel_holds_run_on_triton(gluon_launches: list[str]) -> None:
    """q_len 4 x 16 heads = 64 rows: past the Gluon kernel's 32, so the Triton kernel runs."""
    run_and_check(poisoned_batch([300, 4113], 4, fp8=False), causal=True)
    assert gluon_launches == []


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_row_max_that_jumps_after_settled_tiles(
    fp8: bool, num_splits: int | None, gluon_launches: list[str]
) -> None:
    """The fp8 kernel skips its rescale on tiles where no row's max moved: a key aligned with one
    head's query far into a long request (scaled score ~8 against the random keys' ~3.5) makes that
    row's max jump after many settled tiles, in the last tile for one head and mid-request for
    another, while the other rows' maxima stay put."""
    batch = poisoned_batch([4096 + 17, 300], 1, fp8)
    seq_len = 4096 + 17
    scale = 1.0 if batch["kv_scale"] is None else float(batch["kv_scale"])
    for head, pos in ((3, seq_len - 1), (11, seq_len // 2)):
        query = batch["query"][0, head].float()
        key = 8.0 * (RANK + ROPE) ** 0.5 * query / query.norm() ** 2  # q.k * sm_scale = 8
        row = int(batch["block_table"][0, pos // PAGE]) * PAGE + pos % PAGE
        flat = batch["kv_cache"].view(-1, RANK + ROPE)
        flat[row] = (key / scale).clamp(-448, 448).to(flat.dtype)
    run_and_check(batch, causal=True, num_splits=num_splits)
    assert gluon_launches == expected_kernel(fp8, HEADS)
