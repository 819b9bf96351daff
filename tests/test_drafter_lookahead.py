"""Drafter lookahead with two drafters present: a Mamba-style drafter (a recurrent draft model
keeps its own state, so drafting writes at most one KV slot past the verified tokens) beside
DeepSeek's MTP (one slot per speculative token). `combined_lookahead` takes the larger, and the
P/D backoff (`exportable_tokens`) and the scheduler's reservation use that one number."""

from __future__ import annotations

import numpy as np
import pytest
from jackfield.contracts.drafter import (
    DraftContext,
    DrafterOptions,
    DraftProposal,
    ModelDrafter,
    combined_lookahead,
    exportable_tokens,
)
from jackfield.contracts.sampler import SamplingParams
from jackfield.engine.block_manager import BlockManager
from jackfield.engine.drafting import DraftLimits
from jackfield.engine.scheduler import Scheduler
from jackfield.engine.sequence import Sequence
from jackfield_spec_decode.dflash import DFlashDrafter
from jackfield_spec_decode.dspark import DSparkDrafter
from jackfield_spec_decode.mtp import MTPDrafter


class MambaStyleDrafter(ModelDrafter):
    """Its recurrent state carries the drafted tokens; only the first draft's row is written to
    the target's KV cache past the verified tokens."""

    name = "mamba_style"

    @property
    def lookahead_tokens(self) -> int:
        return 1

    def propose(self, context: DraftContext) -> DraftProposal:
        raise NotImplementedError("only its lookahead is under test")


@pytest.mark.parametrize("k", [1, 3, 5])
def test_combined_lookahead_is_the_larger_of_mamba_and_mtp(k: int) -> None:
    mamba = MambaStyleDrafter(DrafterOptions(num_speculative_tokens=4))
    mtp = MTPDrafter(DrafterOptions(num_speculative_tokens=k))
    assert mamba.lookahead_tokens == 1 and mtp.lookahead_tokens == k
    assert combined_lookahead([mamba, mtp]) == combined_lookahead([mtp, mamba]) == max(1, k)
    assert combined_lookahead([mamba]) == 1 and combined_lookahead([]) == 0


def test_backoff_and_reservation_follow_the_combined_lookahead() -> None:
    mamba = MambaStyleDrafter(DrafterOptions(num_speculative_tokens=4))
    mtp = MTPDrafter(DrafterOptions(num_speculative_tokens=3))
    lookahead = combined_lookahead([mamba, mtp])
    # 3 unverified draft slots past 10 verified tokens: exported up to the verified ones only
    assert exportable_tokens(13, lookahead, 10) == 10
    with pytest.raises(ValueError, match="exceed the lookahead of 1"):
        exportable_tokens(13, mamba.lookahead_tokens, 10)  # the Mamba drafter alone allows one slot
    # The scheduler reserves the combined lookahead past a running request's rows.
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=64, lookahead=lookahead)
    seq = Sequence(0, 6, list(range(6)), SamplingParams(max_tokens=8), seed=0)
    scheduler.add(seq)
    scheduler.schedule()  # first step: the prompt only (the P/D rule: no lookahead yet)
    assert len(seq.block_table) == 2
    seq.num_computed, seq.token_ids = 6, seq.token_ids + [7]
    scheduler.schedule()  # a decode of position 6: slots up to 7 + 3 = 10 held
    assert len(seq.block_table) == 3


@pytest.mark.parametrize("extra_block_rows", [None, 1, 0])
def test_drafts_are_bounded_by_the_slots_their_rows_write(extra_block_rows: int | None) -> None:
    """A chain drafter's last row (draft d - 1) sits at N + d - 3; a block drafter's block of
    d + e rows ends at N - 2 + d + e (DFlash e = 1, DSpark e = 0): each may draft exactly as
    many tokens as keep that row inside the request's blocks."""
    block_size, blocks = 4, [0, 1, 2]
    limits = DraftLimits(num_speculative_tokens=16, max_model_len=1024, block_size=block_size,
                         extra_block_rows=extra_block_rows)
    seq = Sequence(0, 6, list(range(6)), SamplingParams(max_tokens=100), seed=0)
    seq.block_tables = [blocks]
    d = int(limits.max_drafts([seq], np.array([1]))[0, 0])
    n = seq.num_tokens + 1
    last_row = n + d - 3 if extra_block_rows is None else n - 2 + d + extra_block_rows
    assert last_row == len(blocks) * block_size - 1  # the last slot the request holds, no further
    if extra_block_rows is not None:
        kind = {1: DFlashDrafter, 0: DSparkDrafter}[extra_block_rows]
        drafter = kind(DrafterOptions(num_speculative_tokens=3))
        assert drafter.extra_block_rows == extra_block_rows
        assert drafter.lookahead_tokens == 3 + extra_block_rows
