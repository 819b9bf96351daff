"""cpu_offload through the engine: greedy tokens identical with and without offload (the engine
without offload is itself held to transformers elsewhere) while the prefix, evicted from a small
device pool, is served from the CPU tier; DeepSeek (MLA) and Granite SWA (GQA, KV groups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.cli import main
from jackfield.config import ConfigError
from jackfield.testing.checkpoints import write_deepseek, write_granite

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32",
        "engine.block_size": 16, "engine.max_num_seqs": 4}
# Bytes of one block id: DeepSeek 3 MLA layers x 16 tokens x (32 + 8) floats; Granite SWA one
# shared tensor (4 groups of one layer) of [2, blocks, 16, 2 heads, 8] floats.
BLOCK_BYTES = {"deepseek": 3 * 16 * 40 * 4, "granite_swa": 2 * 16 * 2 * 8 * 4}
DEVICE_BLOCKS = {"deepseek": 24, "granite_swa": 48}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("offload_models")
    write_deepseek("v3", root / "deepseek")
    # a window of 20 over 16-token blocks: a window group keeps 2 chunks of one block
    write_granite("granite_swa", root / "granite_swa", max_position_embeddings=256, sliding_window=20)
    return {"deepseek": root / "deepseek", "granite_swa": root / "granite_swa"}


def offload(blocks_per_chunk: int = 1, **options: object) -> dict[str, object]:
    return {"kv_connector.name": "cpu_offload",
            "kv_connector.options": {"cpu_bytes": 1 << 22, "blocks_per_chunk": blocks_per_chunk, **options}}


def make_llm(model: Path, family: str, **overrides: object) -> LLM:
    budget = DEVICE_BLOCKS[family] * BLOCK_BYTES[family] / 2**30
    return LLM(model, **{**BASE, "engine.cpu_kv_cache_gib": budget, **overrides})


def workload(vocab: int, seed: int) -> list[list[list[int]]]:
    """Rounds of generate calls: a shared prefix, fillers that push it out of the device pool,
    then the prefix again (alone, and beside fresh requests in one batch)."""
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    prefix = tokens(66)
    fillers = [[tokens(70)] for _ in range(6)]
    again = [[prefix + tokens(5)], [tokens(40), prefix + tokens(9), tokens(33)]]
    return [[prefix + tokens(3)], *fillers, *again]


def run(llm: LLM, rounds: list[list[list[int]]]) -> list[list[int]]:
    return [out.token_ids for prompts in rounds for out in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(("family", "blocks_per_chunk"), [("deepseek", 2), ("granite_swa", 1)])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_greedy_identical_with_hits_from_the_cpu_tier(model_dirs: dict[str, Path], family: str,
                                                      blocks_per_chunk: int, policy: str) -> None:
    vocab = 256 if family == "deepseek" else 97
    rounds = workload(vocab, seed=7)
    plain = make_llm(model_dirs[family], family)
    expected = run(plain, rounds)
    assert plain.engine.kv_connector_stats() is None
    llm = make_llm(model_dirs[family], family, **offload(blocks_per_chunk, eviction_policy=policy))
    assert run(llm, rounds) == expected
    stats = llm.engine.kv_connector_stats()
    assert stats is not None and stats["name"] == "cpu_offload"
    assert stats["hit_tokens"] > 0 and stats["loaded_chunks"] > 0 and stats["stored_chunks"] > 0
    assert stats["failed_loads"] == 0 and stats["failed_saves"] == 0
    assert not llm.engine.scheduler.has_work() and not llm.engine.scheduler.held


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_a_failed_load_is_recomputed_never_read(model_dirs: dict[str, Path], monkeypatch,
                                                load_mode: str) -> None:
    """Layerwise: the step that loads the request computes over the half-loaded blocks; the
    engine drops that step's output and the request computes its prefix again."""
    from jackfield_kv_offload import transfer

    rounds = workload(256, seed=11)
    expected = run(make_llm(model_dirs["deepseek"], "deepseek"), rounds)
    llm = make_llm(model_dirs["deepseek"], "deepseek", **offload(2, load_mode=load_mode))
    real_load = transfer.HostPool.load_layer
    calls = {"n": 0}

    def partial_load(self: transfer.HostPool, layer: int, pairs: object) -> None:
        calls["n"] += 1
        if layer == 1:  # layer 0 arrives, layer 1 fails: the blocks hold half a prefix
            raise RuntimeError("injected transfer fault")
        real_load(self, layer, pairs)

    monkeypatch.setattr(transfer.HostPool, "load_layer", partial_load)
    assert run(llm, rounds) == expected
    stats = llm.engine.kv_connector_stats()
    assert stats is not None and stats["failed_loads"] > 0 and calls["n"] > 0


def test_a_failed_store_frees_its_chunks(model_dirs: dict[str, Path], monkeypatch) -> None:
    from jackfield_kv_offload import transfer

    rounds = workload(256, seed=12)
    expected = run(make_llm(model_dirs["deepseek"], "deepseek"), rounds)
    llm = make_llm(model_dirs["deepseek"], "deepseek", **offload(2))
    real_store = transfer.HostPool.store_layer

    def failing_store(self: transfer.HostPool, layer: int, pairs: object) -> None:
        real_store(self, layer, pairs)
        if layer == 2:
            raise RuntimeError("injected transfer fault")

    monkeypatch.setattr(transfer.HostPool, "store_layer", failing_store)
    assert run(llm, rounds) == expected
    stats = llm.engine.kv_connector_stats()
    assert stats is not None and stats["failed_saves"] > 0
    assert stats["hit_tokens"] == 0 and stats["cpu_chunks_held"] == 0  # nothing half-written is served


@pytest.mark.parametrize(("family", "blocks_per_chunk"), [("deepseek", 2), ("granite_swa", 1)])
@pytest.mark.parametrize(("load_mode", "steps_to_first_token"), [("layerwise", 1), ("async", 2)])
def test_a_cpu_hit_is_loaded_in_the_step_that_computes_it(model_dirs: dict[str, Path], family: str,
                                                          blocks_per_chunk: int, load_mode: str,
                                                          steps_to_first_token: int) -> None:
    """Layerwise: the request's first token comes out of the step that loads its prefix from the
    CPU tier; async: that step only loads, the next computes."""
    from jackfield.engine.sequence import Status

    vocab = 256 if family == "deepseek" else 97
    rounds = workload(vocab, seed=19)
    reference = make_llm(model_dirs[family], family)
    expected = run(reference, rounds[:-2])
    first = reference.generate(rounds[-2], GREEDY)[0].token_ids
    llm = make_llm(model_dirs[family], family, **offload(blocks_per_chunk, load_mode=load_mode))
    assert run(llm, rounds[:-2]) == expected  # the prefix is now on the CPU tier only
    engine = llm.engine
    stats = engine.kv_connector_stats()
    assert stats is not None
    hits_before = stats["hit_tokens"]
    seq = engine.add_request(rounds[-2][0], GREEDY)
    for _ in range(steps_to_first_token - 1):
        engine.step()
        assert seq.status == Status.LOADING and not seq.output_ids
    engine.step()
    assert len(seq.output_ids) == 1 and seq.first_token_time is not None
    stats = engine.kv_connector_stats()
    assert stats is not None and stats["hit_tokens"] > hits_before and stats["failed_loads"] == 0
    assert seq.num_cached_prefix == 0  # nothing of it was on the device: the hit came from the CPU
    while engine.scheduler.has_work():
        engine.step()
    assert seq.output_ids == first


def test_a_loading_request_waits_without_blocking_others(model_dirs: dict[str, Path]) -> None:
    """Async loads: the worker's report of a finished load is held back for a few steps: the
    request stays loading (no compute, its blocks held) while a request admitted after it runs
    to the end."""
    from jackfield.contracts.kv_connector import TransferResult
    from jackfield.engine.sequence import Status

    rounds = workload(256, seed=13)
    expected = run(make_llm(model_dirs["deepseek"], "deepseek"), rounds[:-2])
    llm = make_llm(model_dirs["deepseek"], "deepseek", **offload(2, load_mode="async"))
    assert run(llm, rounds[:-2]) == expected  # the prefix is now on the CPU tier only
    engine, worker = llm.engine, llm.engine.runner.connector
    assert worker is not None
    real = worker.get_finished
    held: list[TransferResult] = []

    def late_report() -> TransferResult:
        result = real()
        held.append(result)
        if len(held) <= 3:  # nothing reported for three steps
            return TransferResult(saved=result.saved)
        return TransferResult(saved=result.saved, loaded=frozenset().union(*(r.loaded for r in held)))

    worker.get_finished = late_report  # type: ignore[method-assign]
    prefix_request = engine.add_request(rounds[-2][0], GREEDY)
    other = engine.add_request(list(range(20)), SamplingParams(temperature=0.0, max_tokens=2,
                                                               ignore_eos=True))
    finished = engine.step() + engine.step() + engine.step()
    assert prefix_request.status == Status.LOADING and prefix_request.num_loading > 0
    assert prefix_request.num_computed + prefix_request.num_loading == 64
    assert other in finished  # admitted behind it, done while it waited
    while engine.scheduler.has_work():
        engine.step()
    reference = make_llm(model_dirs["deepseek"], "deepseek").generate(rounds[-2], GREEDY)[0].token_ids
    assert prefix_request.output_ids == reference


def test_two_engines_with_one_seed_share_keys(model_dirs: dict[str, Path]) -> None:
    """Keys are the block manager's chained hashes from engine.prefix_hash_seed: the same in two
    engines (and processes) with the same seed, different with another seed."""
    prompt = list(range(40))
    keys = []
    for seed in (5, 5, 6):
        llm = make_llm(model_dirs["deepseek"], "deepseek", **{**offload(), "engine.prefix_hash_seed": seed})
        seq = llm.engine.add_request(prompt, GREEDY)
        keys.append(llm.engine.scheduler.connector_request(seq).block_hashes)
    assert keys[0] == keys[1] and keys[0] != keys[2] and len(keys[0]) == 2
    # another process (hash randomization applies to str and bytes, never to these int tuples)
    code = ("from jackfield.engine.block_manager import block_hash; "
            f"h = block_hash(5, {prompt[:16]}); print(h, block_hash(h, {prompt[16:32]}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"}).stdout.split()
    assert tuple(map(int, out)) == keys[0]


@pytest.mark.parametrize(("options", "field"), [
    ({"eviction_policy": "fifo"}, "kv_connector.options.eviction_policy"),
    ({"blocks_per_chunk": 0}, "kv_connector.options.blocks_per_chunk"),
    ({"cpu_bytes": 1000}, "kv_connector.options.cpu_bytes"),
    ({"store_threshold": 0}, "kv_connector.options.store_threshold"),
    ({"load_mode": "sync"}, "kv_connector.options.load_mode"),
    ({"colour": "red"}, "kv_connector.options.colour"),
])
def test_bad_options_fail_at_start_up_naming_the_field(model_dirs: dict[str, Path],
                                                       options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make_llm(model_dirs["deepseek"], "deepseek", **{"kv_connector.name": "cpu_offload",
                                                        "kv_connector.options": options})


def test_unknown_connector_lists_the_installed_ones(model_dirs: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="no kv_connector named 'gpu_offload'; registered: .*cpu_offload"):
        make_llm(model_dirs["deepseek"], "deepseek", **{"kv_connector.name": "gpu_offload"})
    config = tmp_path / "jackfield.toml"
    config.write_text(f'[model]\npath = "{model_dirs["deepseek"]}"\n[kv_connector]\nname = "gpu_offload"\n'
                      '[kv_connector.options]\neviction_policy = "fifo"\n')
    assert main(["doctor", "--config", str(config)]) == 2
    out = capsys.readouterr().out
    assert "no kv_connector named 'gpu_offload'" in out and "cpu_offload" in out
    config.write_text(f'[model]\npath = "{model_dirs["deepseek"]}"\n[kv_connector]\nname = "cpu_offload"\n'
                      '[kv_connector.options]\neviction_policy = "fifo"\n')
    assert main(["doctor", "--config", str(config)]) == 2
    assert "kv_connector.options.eviction_policy" in capsys.readouterr().out


def test_run_json_reports_the_connector(model_dirs: dict[str, Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompt = ",".join(str(t) for t in range(50))
    args = ["run", "--model", str(model_dirs["deepseek"]), "--json", "--max-tokens", "2",
            "--temperature", "0", "--prompt-token-ids", prompt, "--prompt-token-ids", prompt,
            *[f"--set={k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in BASE.items()],
            "--set=kv_connector.name=\"cpu_offload\"", "--set=kv_connector.options={blocks_per_chunk = 1}"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["kv_connector"]["name"] == "cpu_offload"
    assert summary["kv_connector"]["stored_chunks"] == 3  # 50 tokens: 3 full 16-token blocks


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek", "granite_swa"])
@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_greedy_identical_on_cuda_with_hits_from_pinned_memory(model_dirs: dict[str, Path],
                                                               family: str, load_mode: str) -> None:
    """The CUDA path: pinned host pool, copies on their own streams, overlapped with the forward
    (layerwise: each layer's attention waits on its copy's event). The device pool is capped by
    max_num_seqs x max_model_len, so the fillers evict the prefix."""
    vocab = 256 if family == "deepseek" else 97
    rounds = workload(vocab, seed=17)
    cuda = {**BASE, "engine.device": "cuda", "engine.max_model_len": 88}
    expected = run(LLM(model_dirs[family], **cuda), rounds)
    llm = LLM(model_dirs[family], **cuda, **offload(2 if family == "deepseek" else 1, load_mode=load_mode))
    assert run(llm, rounds) == expected
    stats = llm.engine.kv_connector_stats()
    assert stats is not None and stats["hit_tokens"] > 0 and stats["failed_loads"] == 0
