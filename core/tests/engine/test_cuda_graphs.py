"""Decode CUDA graphs: which batch sizes are recorded and when the engine runs eagerly.

Recording and replay need a GPU and a graph-capable backend: plugins/cuda_mla/tests/
test_gpu_engine.py compares replayed and eager tokens there.
"""

from __future__ import annotations

from jackfield import LLM, SamplingParams
from jackfield.engine.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    for max_num_seqs in (1, 3, 17, 100):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        assert all(any(s >= n for s in sizes) for n in range(1, max_num_seqs + 1))


def test_engine_says_why_decode_runs_eagerly(v3_dir) -> None:
    llm = LLM(str(v3_dir), **{"engine.device": "cpu"})
    assert llm.engine.runner.decode_graphs_off == "the device is cpu"
    assert llm.engine.runner.graphs is None


def test_start_up_warm_up_leaves_nothing_behind(v3_dir) -> None:
    """The warm-up request (run at start-up on CUDA) frees its blocks, caches no prefix block and
    restarts request ids; here it is called directly on the CPU engine."""
    llm = LLM(str(v3_dir), **{"engine.device": "cpu", "engine.enable_prefix_caching": True})
    free = llm.engine.block_manager.num_free
    llm.engine._warm_up()
    assert llm.engine.block_manager.num_free == free
    assert not llm.engine.block_manager.cached
    assert not llm.engine.scheduler.has_work()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.request_id == 0 and len(out.token_ids) == 2


def test_only_steps_of_sampling_decodes_are_replayed(v3_dir) -> None:
    """A one-token slice of a chunked prefill has one row but samples nothing: a step holding it
    runs eagerly (the replayed path assumes every row samples and the step ends in a sync)."""
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.engine.scheduler import ScheduledChunk
    from jackfield.engine.sequence import Sequence

    llm = LLM(str(v3_dir), **{"engine.device": "cpu", "engine.max_num_seqs": 4})
    runner = llm.engine.runner
    graphs = DecodeGraphs(llm.engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, llm.config.engine.block_size,
                          llm.engine.max_model_len, 4, llm.engine.device)
    params = SamplingParams(max_tokens=4)
    decoding = Sequence(0, 3, [5, 6, 7, 8], params, seed=0, num_computed=3)  # its 4th token is new
    prefilling = Sequence(1, 40, list(range(40)), params, seed=0, num_computed=9)
    assert graphs.query_len([ScheduledChunk(decoding, 1)]) == 1
    assert graphs.query_len([ScheduledChunk(decoding, 1), ScheduledChunk(prefilling, 1)]) is None
    assert graphs.query_len([ScheduledChunk(decoding, 1)] * 5) is None  # past the largest captured batch
    decoding.draft_ids = [9, 9]
    assert graphs.query_len([ScheduledChunk(decoding, 3, num_drafts=2)]) is None  # no verify graphs recorded


def test_piece_sizes_cover_every_token_count_up_to_the_cap() -> None:
    from jackfield.engine.piecewise_graphs import piece_sizes

    assert piece_sizes(16) == [16]
    assert piece_sizes(96) == [16, 32, 64, 96]
    assert piece_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    for cap in (1, 17, 100, 3000, 8192):
        sizes = piece_sizes(cap)
        assert sizes == sorted(set(sizes)) and sizes[-1] == cap
        assert all(any(s >= n for s in sizes) for n in range(1, cap + 1))
        # padding: at most doubles a small step, at most 511 rows on a large one
        assert all(next(s for s in sizes if s >= n) <= max(2 * n, n + 511, 16) for n in range(1, cap + 1))


def test_engine_says_why_prefill_runs_eagerly(v3_dir) -> None:
    llm = LLM(str(v3_dir), **{"engine.device": "cpu"})
    assert llm.engine.runner.prefill_graphs_off == "the device is cpu"
    assert llm.engine.runner.pieces is None


def test_prefill_graph_cap_is_checked(v3_dir) -> None:
    import pytest
    from jackfield.config import ConfigError

    with pytest.raises(ConfigError, match="prefill_graph_max_tokens must be >= 0"):
        LLM(str(v3_dir), **{"engine.device": "cpu", "engine.prefill_graph_max_tokens": -1})


def test_pieces_over_static_buffers_give_the_eager_tokens(v3_dir) -> None:
    """The replay's data flow without the graphs (record=False: the same pieces, static buffers,
    padding to the recorded sizes, eager attention between pieces) on the CPU in float32: chunked
    prefills mixed with decodes give the eager engine's tokens and logprobs. The recording itself
    is checked on the GPU (plugins/cuda_mla/tests/test_gpu_engine.py)."""
    import torch
    from jackfield.engine.piecewise_graphs import PiecewiseGraphs

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 250, (n,), generator=gen).tolist() for n in (5, 40, 70, 23)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=3, ignore_eos=True)
              for n in (9, 4, 7, 6)]
    settings = {"engine.device": "cpu", "engine.max_num_batched_tokens": 48,
                "engine.enable_prefix_caching": False}
    eager = LLM(str(v3_dir), **settings).generate(prompts, params)
    llm = LLM(str(v3_dir), **settings)
    pieces = PiecewiseGraphs(llm.engine.model, 48, llm.engine.device, record=False)
    pieces.capture()
    assert pieces.sizes == [16, 32, 48]
    llm.engine.runner.pieces = pieces
    replayed = llm.generate(prompts, params)
    # The indexer scores keys by sums of ReLUs, so keys tie or nearly tie; an eager step scores
    # its rows' keys up to the step's longest context, a replay up to max_model_len (other einsum
    # shapes and chunks), which may round differently by an ulp, and a near tie at the top-4
    # boundary then selects another key
    # (seed 3181184273: one position of 71 off by 0.023, the tokens unchanged; the same at
    # 99954d1). Such positions are allowed, one in 25; a replay that reads wrong buffers moves most.
    apart = []
    for r, (want, got) in enumerate(zip(eager, replayed, strict=True)):
        assert got.token_ids == want.token_ids
        for i, (w, g) in enumerate(zip(want.logprobs, got.logprobs, strict=True)):
            common = w.keys() & g.keys()  # top-3 sets part only at a tie for third place
            gap = max(abs(w[t] - g[t]) for t in common)
            if gap >= 1e-4:
                apart.append((r, i, gap))
                continue
            for only, other in ((w.keys() - common, g), (g.keys() - common, w)):
                assert all(abs(w.get(t, g.get(t, 0.0)) - min(other.values())) < 1e-4 for t in only), (w, g)
    positions = sum(len(o.logprobs) for o in eager)
    print(f"positions apart (request, position, max |logprob diff|): {apart} of {positions}")
    assert len(apart) * 25 <= positions, apart


def test_graph_buffers_hold_each_kv_groups_slots_and_tables(tmp_path, rng_seed: int) -> None:
    """Granite SWA (window layers beside full ones: several KV cache groups): the decode graphs' static
    buffers, filled for a step of decodes past the window, hold each group's slots, block tables,
    token ids and positions as the eager step's metadata has them; padded rows write nothing.
    (On the CPU the buffers are host tensors; recording itself needs a GPU.)"""
    import torch
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.testing.checkpoints import write_granite

    write_granite("granite_swa", tmp_path / "swa")
    llm = LLM(str(tmp_path / "swa"), device="cpu", backend="torch_ref", block_size=4, max_num_seqs=8)
    engine, runner = llm.engine, llm.engine.runner
    num_groups = len(runner.groups.windows)
    assert num_groups > 1 and None in runner.groups.windows and 3 in runner.groups.windows
    g = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_requests([(p, params) for p in prompts])
    for _ in range(12):  # every request decodes, past its window (3): trimmed window tables
        engine.step()
    chunks = engine.scheduler.schedule()
    assert len(chunks) == 3 and all(c.num_tokens == 1 for c in chunks)
    graphs = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, runner.block_size,
                          engine.max_model_len, 8, engine.device)
    size = next(s for s in graphs.sizes if s >= len(chunks))
    assert size > len(chunks)  # a padded row too
    graphs._fill(chunks, size, 1)
    per_group, input_ids, positions = runner._metadata(chunks)
    n = len(chunks)
    assert graphs.input_ids.gpu[:n].tolist() == input_ids
    assert torch.equal(graphs.positions.gpu[:n], positions)
    for group, eager in enumerate(per_group):
        assert torch.equal(graphs.slot_mapping[group].gpu[:n], eager.slot_mapping)
        assert (graphs.slot_mapping[group].gpu[n:size] == -1).all()
        for row, seq_len in enumerate(eager.seq_lens_cpu.tolist()):
            used = -(-seq_len // runner.block_size)
            assert torch.equal(graphs.block_table[group].gpu[row, :used], eager.block_table[row, :used])
    assert len({tuple(md.slot_mapping.tolist()) for md in per_group}) > 1  # the groups' slots differ


def test_verify_buffers_pad_each_request_to_the_recorded_rows(tmp_path, rng_seed: int) -> None:
    """A verify step (n-gram drafts, fewer than k for some requests) in the graphs' buffers, Granite
    SWA (several KV cache groups): each request's token and drafts sit in its first rows with the
    eager step's ids, positions and slots in every group; its padding rows (up to 1 + k) write
    nothing; lengths count the padding (the kernels place row i at seq_len - q + i); the real rows
    are gathered back in the eager step's order."""
    import torch
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.testing.checkpoints import write_granite

    write_granite("granite_swa", tmp_path / "swa")
    k = 3
    llm = LLM(str(tmp_path / "swa"), device="cpu", backend="torch_ref", block_size=4, max_num_seqs=8,
              **{"speculative.method": "ngram", "speculative.num_speculative_tokens": k,
                 "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 2})
    engine, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(rng_seed)
    # A repeated motif drafts at once (its last token recurs); tokens that occur once each do
    # not, until the model repeats one: the first decode steps mix draft counts whatever the seed.
    motif = torch.randint(0, 6, (4,), generator=g).tolist()
    prompts = [motif * 3, list(range(20, 29)), torch.randint(0, 6, (14,), generator=g).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_requests([(p, params) for p in prompts])
    graphs = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, runner.block_size,
                          engine.max_model_len, 8, engine.device, query_lens=(1, 1 + k))
    checked: list[int] = []
    eager_step = runner.step

    def check_then_step(chunks, metadata=None):  # type: ignore[no-untyped-def]
        counts = {c.num_drafts for c in chunks}
        if not checked and all(c.is_decode for c in chunks) and len(counts) > 1 and max(counts) > 0:
            checked.append(check_verify_fill(graphs, runner, chunks, 1 + k))
        return eager_step(chunks, metadata)

    runner.step = check_then_step
    for _ in range(40):
        if checked or not engine.scheduler.has_work():
            break
        engine.step()
    assert checked, "no verify step with mixed draft counts (the n-gram drafter proposed too little)"


def check_verify_fill(graphs, runner, chunks, q: int) -> int:  # type: ignore[no-untyped-def]
    import torch

    size = next(s for s in graphs.sizes if s >= len(chunks))
    assert graphs.query_len(chunks) == q
    total = graphs._fill(chunks, size, q)
    per_group, input_ids, positions = runner._metadata(chunks)
    assert total == len(input_ids) == sum(c.num_tokens for c in chunks)
    real = [i * q + j for i, c in enumerate(chunks) for j in range(c.num_tokens)]
    padding = [r for r in range(size * q) if r not in real]
    assert graphs.real_rows.gpu[:total].tolist() == real
    assert graphs.input_ids.gpu[real].tolist() == input_ids
    assert torch.equal(graphs.positions.gpu[real], positions)
    starts = [c.seq.num_computed for c in chunks]
    assert graphs.seq_lens.gpu[: len(chunks)].tolist() == [s + q for s in starts]
    assert (graphs.seq_lens.gpu[len(chunks) : size] == 0).all()
    for group, eager in enumerate(per_group):
        slots = graphs.slot_mapping[group].gpu
        assert torch.equal(slots[real], eager.slot_mapping)
        assert (slots[padding] == -1).all()
    for i in range(len(chunks)):  # padding rows follow their request's last real row
        rows = graphs.positions.gpu[i * q : (i + 1) * q].tolist()
        assert rows == list(range(starts[i], starts[i] + q))
    return len(chunks)


def _tensors(tree: object) -> list:  # type: ignore[type-arg]
    """Every tensor in a tree of dataclasses, tuples, lists and dicts."""
    import dataclasses

    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        items = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    elif isinstance(tree, dict):
        items = list(tree.values())
    elif isinstance(tree, list | tuple):
        items = list(tree)
    else:
        return []
    return [t for item in items for t in _tensors(item)]


def test_hybrid_decode_graphs_keep_every_tensor_their_forward_read(tmp_path, monkeypatch) -> None:
    """A hybrid model's decode graphs (Granite 4.0 hybrid, Mamba2 beside attention): recording runs
    the forward over the padded decode metadata (padding rows on the pool's spare slot, from a
    zero state), and the memory of every tensor the recorded forwards read lives as long as the
    graphs. A replay reads it by address: on the H200, replays after the recurrent metadata made
    for the capture was freed indexed with whatever reused its memory ("index out of bounds").
    Recording is emulated on the CPU: the forward runs eagerly, as at each graph's warm-up."""
    import contextlib
    import gc
    import weakref

    import torch
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.testing.checkpoints import write_hybrid

    write_hybrid("granitemoehybrid_dense_nope", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", backend="torch_ref", block_size=4, max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, runner.block_size,
                          engine.max_model_len, 4, engine.device, recurrent=runner.recurrent)
    read: list[weakref.ref] = []  # type: ignore[type-arg]
    forward = engine.model.forward

    def recorded_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        read.extend(weakref.ref(t.untyped_storage()) for t in _tensors([args, kwargs]))
        return forward(*args, **kwargs)

    class Graph:  # what capture asks of a CUDA graph: nothing until a replay
        pass

    monkeypatch.setattr(engine.model, "forward", recorded_forward)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)  # a pool: graphs are "recorded"
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    graphs.capture()
    gc.collect()
    assert sorted(graphs.graphs) == [(1, 1), (2, 1), (4, 1)]
    pool = runner.recurrent.states[0].untyped_storage()
    assert any(ref() is pool for ref in read)  # the walk reached the step's recurrent part
    dead = sum(ref() is None for ref in read)
    assert read and not dead, f"{dead} of {len(read)} tensors the recorded forwards read were freed"


def test_v32_decode_over_static_buffers_gives_the_eager_tokens(tmp_path, rng_seed: int) -> None:
    """DeepSeek-V3.2 (indexer top-k of 4 among up to 60 keys) decoded as the graphs replay it
    (record=False: the static buffers, batches padded to the captured sizes, the capture-time
    metadata whose max_seq_len is max_model_len, so the indexer's static top-k width and bound;
    verify steps of 1 + k rows a request from an n-gram drafter) with prefill pieces over static
    buffers too, on the CPU in float32 through torch_ref: the eager engine's tokens and logprobs."""
    import torch
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.engine.piecewise_graphs import PiecewiseGraphs
    from jackfield.testing.checkpoints import write_deepseek_v32

    print(f"seed={rng_seed}")
    write_deepseek_v32(tmp_path / "v32", index_topk=4)
    k = 2
    settings = {"device": "cpu", "backend": "torch_ref", "block_size": 4, "max_num_seqs": 4,
                "engine.max_num_batched_tokens": 16, "engine.enable_prefix_caching": False,
                "speculative.method": "ngram", "speculative.num_speculative_tokens": k,
                "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 2}
    gen = torch.Generator().manual_seed(rng_seed)
    # a small alphabet: the last token recurs in the prompt, so n-gram lookup drafts
    prompts = [torch.randint(0, 6, (n,), generator=gen).tolist() for n in (9, 30, 5, 21)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=3, ignore_eos=True)
              for n in (20, 14, 25, 12)]
    eager = LLM(str(tmp_path / "v32"), **settings).generate(prompts, params)
    llm = LLM(str(tmp_path / "v32"), **settings)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, runner.block_size,
                          engine.max_model_len, 4, engine.device, query_lens=(1, 1 + k), record=False)
    graphs.capture()
    replayed_rows: list[int] = []
    run = graphs.run

    def counted_run(chunks, q, taps=None):  # type: ignore[no-untyped-def]
        replayed_rows.append(q)
        return run(chunks, q, taps)

    graphs.run = counted_run  # type: ignore[method-assign]
    runner.graphs = graphs
    runner.pieces = PiecewiseGraphs(engine.model, 16, engine.device, record=False)
    runner.pieces.capture()
    replayed = llm.generate(prompts, params)
    assert {1, 1 + k} <= set(replayed_rows), replayed_rows  # decode and verify steps replayed
    # The indexer scores keys by sums of ReLUs, so keys tie or nearly tie; an eager step scores
    # its rows' keys up to the step's longest context, a replay up to max_model_len (other einsum
    # shapes and chunks), which may round differently by an ulp, and a near tie at the top-4
    # boundary then selects another key
    # (seed 3181184273: one position of 71 off by 0.023, the tokens unchanged; the same at
    # 99954d1). Such positions are allowed, one in 25; a replay that reads wrong buffers moves most.
    apart = []
    for r, (want, got) in enumerate(zip(eager, replayed, strict=True)):
        assert got.token_ids == want.token_ids
        for i, (w, g) in enumerate(zip(want.logprobs, got.logprobs, strict=True)):
            common = w.keys() & g.keys()  # top-3 sets part only at a tie for third place
            gap = max(abs(w[t] - g[t]) for t in common)
            if gap >= 1e-4:
                apart.append((r, i, gap))
                continue
            for only, other in ((w.keys() - common, g), (g.keys() - common, w)):
                assert all(abs(w.get(t, g.get(t, 0.0)) - min(other.values())) < 1e-4 for t in only), (w, g)
    positions = sum(len(o.logprobs) for o in eager)
    print(f"positions apart (request, position, max |logprob diff|): {apart} of {positions}")
    assert len(apart) * 25 <= positions, apart
