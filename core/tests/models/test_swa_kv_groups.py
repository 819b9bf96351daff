"""Sliding-window layers keep only the KV their window needs, through the whole engine: greedy
tokens equal transformers' for prompts many windows long, with chunked prefill, preemption and
every cache poisoned (random blocks, a huge null block); and one KV budget serves concurrently
what a single shared block table had to preempt for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.engine.block_manager import NULL_BLOCK, BlockManager
from jackfield.engine.scheduler import Scheduler
from jackfield.engine.sequence import Sequence
from jackfield.testing.checkpoints import greedy_reference, write_granite

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = (120, 100, 90)  # 30-40 windows of 3 tokens
LAYER_BLOCK_BYTES = 2 * 4 * 2 * 8 * 4  # (k, v) x block_size 4 x 2 kv heads x head_dim 8 x float32


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, list[list[int]]]:
    path = tmp_path_factory.mktemp("swa") / "granite_swa"
    hf_model = write_granite("granite_swa", path, max_position_embeddings=256)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in LENGTHS]
    return hf_model, path, prompts


def _llm(path: Path, budget_bytes: int) -> LLM:
    return LLM(
        path,
        backend="torch_ref",
        block_size=4,
        max_num_batched_tokens=8,
        cpu_kv_cache_gib=budget_bytes / 2**30,
        enable_prefix_caching=False,
    )


def _poison(llm: LLM) -> None:
    """Unwritten slots hold noise; the null block holds 1e4, so any weight on it shows."""
    for cache in {id(c): c for c in llm.engine.runner.kv_caches}.values():
        cache.normal_()
        cache[:, NULL_BLOCK] = 1e4


def _track_window_blocks(llm: LLM) -> list[int]:
    """Records, at every step, the most real blocks one window table of a running request holds."""
    peaks: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        chunks = schedule()
        windowed = [g for g, w in enumerate(llm.engine.runner.kv.groups.windows) if w is not None]
        tables = [c.seq.block_tables[g] for c in chunks for g in windowed]
        peaks.append(max(sum(b != NULL_BLOCK for b in table) for table in tables))
        return chunks

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return peaks


def test_window_groups_match_transformers_with_chunked_prefill_and_preemption(swa_model) -> None:  # type: ignore[no-untyped-def]
    hf_model, path, prompts = swa_model
    llm = _llm(path, 50 * LAYER_BLOCK_BYTES)  # 50 block ids: too few for all three at once
    assert llm.engine.runner.kv.groups.windows == (None, 3, 3, 3) and llm.engine.runner.kv.num_blocks == 50
    _poison(llm)
    peaks = _track_window_blocks(llm)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0
    # prefill chunks of 8: a window table spans at most 3 - 1 + 8 tokens; decodes 3 tokens
    assert max(peaks) <= 4 and peaks[-1] <= -(-3 // 4) + 1
    for prompt, out in zip(prompts, outs, strict=True):
        want, _ = greedy_reference(hf_model, prompt, MAX_NEW)
        assert out.token_ids == want


def _preemptions_with_one_shared_table(num_blocks: int, prompts: list[list[int]]) -> int:
    """The engine before KV cache groups: every layer in one table per request (scheduler only)."""
    sched = Scheduler(BlockManager(num_blocks, 4, False), max_num_seqs=64, max_num_batched_tokens=8)
    seqs = [Sequence(i, len(p), list(p), GREEDY, 0) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    while sched.has_work():
        for c in sched.schedule():
            samples = c.samples
            c.seq.num_computed += c.num_tokens
            if samples:
                c.seq.token_ids.append(1)
                if len(c.seq.output_ids) == MAX_NEW:
                    sched.finish(c.seq, "length")
    return sched.num_preemptions


def test_the_same_budget_runs_without_preemption(swa_model) -> None:  # type: ignore[no-untyped-def]
    hf_model, path, prompts = swa_model
    budget = 40 * 4 * LAYER_BLOCK_BYTES  # 40 blocks of the four layers: the three need 83
    assert _preemptions_with_one_shared_table(40, prompts) > 0
    llm = _llm(path, budget)
    # a block id now holds one layer's block (four groups of one layer)
    assert llm.engine.runner.kv.num_blocks == 160
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_preemptions for o in outs] == [0, 0, 0]
    for prompt, out in zip(prompts, outs, strict=True):
        want, _ = greedy_reference(hf_model, prompt, MAX_NEW)
        assert out.token_ids == want


def test_each_group_builds_its_metadata_once_a_step_and_each_layer_reads_its_group(swa_model) -> None:  # type: ignore[no-untyped-def]
    _, path, prompts = swa_model
    llm = _llm(path, 400 * LAYER_BLOCK_BYTES)
    runner = llm.engine.runner
    builds = [0] * len(runner.kv.groups.windows)
    assert [g.by_role for g in runner.contexts.groups] == [False] * 4  # MHA on one backend: one part
    for group, builder in enumerate(g.decode for g in runner.contexts.groups):
        build = builder.build

        def counted(common, for_capture=False, group=group, build=build):  # type: ignore[no-untyped-def]
            builds[group] += 1
            return build(common, for_capture)

        builder.build = counted  # type: ignore[method-assign]
    for p in prompts[:2]:
        llm.engine.add_request(p, GREEDY)
    for _ in range(30):  # into the windows: the groups' tables now differ
        llm.engine.step()
    assert builds == [30] * 4
    chunks = llm.engine.scheduler.schedule()
    context = runner.contexts.build(runner.kv_caches, runner._metadata(chunks)[0])
    for layer, group in enumerate(runner.kv.groups.layer_group):
        (part,) = context.parts(layer)
        table = part.metadata.block_table
        for row, chunk in enumerate(chunks):
            want = chunk.seq.block_tables[group]
            assert table[row, : len(want)].tolist() == want
        assert (NULL_BLOCK in table[0].tolist()) == (llm.engine.runner.kv.groups.windows[group] is not None)
