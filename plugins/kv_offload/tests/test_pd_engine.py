"""P/D through two engines in two processes (`PDLLM`, `jackfield run --pd`): the same tokens as one
engine (which is itself held to transformers elsewhere) for DeepSeek (MLA) and Granite SWA (GQA,
window groups), while every prompt's whole blocks come from the prefill engine; block counts
derived from token positions; a prefill engine killed mid-transfer ends in recompute, in time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.cli import main
from jackfield.commands import pd as pd_launcher
from jackfield.commands.pd import PDLLM
from jackfield.testing.checkpoints import write_deepseek, write_granite

BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32",
        "engine.block_size": 16, "engine.max_num_seqs": 4}
VOCAB = {"deepseek": 256, "granite_swa": 97}
LENGTHS = (3, 16, 40, 67, 33, 64, 50)  # under a block, whole blocks, and between


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pd_models")
    write_deepseek("v3", root / "deepseek")
    # a window of one block: a drafter's KV lookahead makes window groups send two blocks, not one
    write_granite("granite_swa", root / "granite_swa", max_position_embeddings=256, sliding_window=16)
    return {"deepseek": root / "deepseek", "granite_swa": root / "granite_swa"}


def workload(family: str, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of LENGTHS; greedy, seeded sampling with logprobs, and one that ends at its first token."""
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB[family], (n,), generator=g).tolist() for n in LENGTHS]
    greedy = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=7, ignore_eos=True, logprobs=2)
    first_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    params = [greedy, sampled, greedy, sampled, first_only, greedy, greedy]
    return prompts, params


def expected_blocks(windows: tuple[int | None, ...], prompt_len: int, block: int, lookahead: int) -> int:
    """Blocks the decode engine reads from the prefill engine: it resumes at R (the prompt's whole
    blocks); a full group needs every block before R, a window group (W) those with keys in
    (R - W, R), and `lookahead` more for the draft positions a drafter keeps."""
    resume = prompt_len // block * block
    count = 0
    for window in windows:
        first = 0 if window is None else max(0, resume - (window - 1 + lookahead))
        count += len({p // block for p in range(first, resume)})
    return count


NGRAM = {"speculative.method": "ngram", "speculative.num_speculative_tokens": 3,
         "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 3}


@pytest.mark.parametrize(("family", "drafter"), [("deepseek", {}), ("granite_swa", {}),
                                                 ("deepseek", NGRAM), ("granite_swa", NGRAM)])
def test_outputs_identical_to_one_engine_and_block_counts_agree(model_dirs: dict[str, Path], family: str,
                                                                drafter: dict[str, object]) -> None:
    """With a drafter the decode engine drafts and verifies, and windows keep its lookahead too.
    Sampled tokens then depend on which positions had a draft (a verified draft and a plain draw
    use one seed differently), which the engines' steps decide: there only greedy tokens match."""
    prompts, params = workload(family, seed=21)
    config = {**BASE, **drafter}
    single = LLM(model_dirs[family], **config)
    expected = single.generate(prompts, params, use_tqdm=False)
    windows = single.engine.runner.kv.groups.windows
    # the drafter's declared KV lookahead (n-gram lookup: 0, it writes no KV of its own; MTP: k)
    lookahead = single.engine.drafter.lookahead_tokens if single.engine.drafter is not None else 0
    with PDLLM(model_dirs[family], **config, **{"kv_connector.options": {"timeout_s": 10.0}}) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        decode, prefill = llm.engine.kv_connector_stats(), llm.producer_stats()
    exact = [sp.temperature == 0 or not drafter for sp in params]
    assert [o.token_ids for o, e in zip(got, exact, strict=True) if e] == [
        o.token_ids for o, e in zip(expected, exact, strict=True) if e]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert [o.seed for o in got] == [o.seed for o in expected]
    for mine, theirs, same in zip(got, expected, exact, strict=True):
        if theirs.logprobs is not None and same:
            assert mine.logprobs is not None and len(mine.logprobs) == len(theirs.logprobs)
            for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert decode is not None and prefill is not None
    sent = sum(expected_blocks(windows, len(p), 16, lookahead) for p in prompts)
    read = sum(expected_blocks(windows, len(p), 16, lookahead) for p, sp in zip(prompts, params, strict=True)
               if sp.max_tokens > 1)  # one that ended at its first token never reached the decode engine
    assert prefill["exported_blocks"] == decode["received_chunks"] == sent
    assert decode["loaded_chunks"] == read and decode["hit_tokens"] == sum(
        len(p) // 16 * 16 for p, sp in zip(prompts, params, strict=True) if sp.max_tokens > 1)
    assert decode["failed_loads"] == 0 and decode["aborted_transfers"] == 0


@pytest.mark.parametrize("die_after", [1, 4])  # DeepSeek's 3 layers: in the first transfer, or the second
def test_a_prefill_engine_killed_mid_transfer_ends_in_recompute(model_dirs: dict[str, Path], monkeypatch,
                                                                die_after: int) -> None:
    from jackfield_kv_offload import channel  # noqa: F401 (the child patches it)

    prompts, params = workload("deepseek", seed=23)
    expected = [o.token_ids for o in LLM(model_dirs["deepseek"], **BASE).generate(prompts, params,
                                                                                 use_tqdm=False)]
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the child imports pd_side from here
    import pd_side

    monkeypatch.setattr(pd_launcher, "run_prefill_engine", pd_side.run_prefill_then_die)
    monkeypatch.setenv("PD_TEST_DIE_AFTER", str(die_after))
    timeout_s = 2.0
    with PDLLM(model_dirs["deepseek"], **BASE, **{"kv_connector.options": {"timeout_s": timeout_s}}) as llm:
        start = time.monotonic()
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        elapsed = time.monotonic() - start
        stats = llm.engine.kv_connector_stats()
        assert llm.producer_error is not None and "exited with code 3" in llm.producer_error
    assert got == expected
    assert elapsed < 30 * timeout_s  # no hang: the stream's timeout and the loads' deadlines bound it
    assert stats is not None and stats["aborted_transfers"] == 1  # the torn one, never read


def test_run_pd_json(model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The counts of both engines' connectors: a pinned CPU thread count means no warm-up request
    (which times each count, engine/cpu_threads.py, and is exported as any other)."""
    prompt = ",".join(str(t) for t in range(50))
    args = ["run", "--pd", "--model", str(model_dirs["deepseek"]), "--json", "--max-tokens", "3",
            "--temperature", "0", "--prompt-token-ids", prompt, "--prompt-token-ids", "7,8,9",
            *[f"--set={k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in BASE.items()],
            "--set=engine.cpu_threads=1"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    plain = LLM(model_dirs["deepseek"], **BASE).generate([list(range(50)), [7, 8, 9]],
                                                       SamplingParams(temperature=0.0, max_tokens=3),
                                                       use_tqdm=False)
    assert [o["token_ids"] for o in out["outputs"]] == [o.token_ids for o in plain]
    summary = out["summary"]
    assert summary["kv_connector"]["name"] == "pd" and summary["kv_connector"]["loaded_chunks"] == 3
    assert summary["pd_prefill"] == {"kv_connector": {"name": "pd", "exported_blocks": 3,
                                                      "exported_requests": 2}, "error": None}


def test_pd_refuses_another_connector_and_launcher_options(model_dirs: dict[str, Path]) -> None:
    from jackfield.config import ConfigError

    with pytest.raises(ConfigError, match="--pd runs the pd connector, the config names 'cpu_offload'"):
        PDLLM(model_dirs["deepseek"], **BASE, **{"kv_connector.name": "cpu_offload"})
    with pytest.raises(ConfigError, match="kv_connector.options.role: set by --pd"):
        PDLLM(model_dirs["deepseek"], **BASE, **{"kv_connector.options": {"role": "consumer"}})


def test_a_prefill_engine_that_cannot_start_is_named_in_the_error(model_dirs: dict[str, Path]) -> None:
    from jackfield.config import ConfigError

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the prefill engine is sent to cuda:0)")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="the prefill engine failed to start: .*cuda:0"):
        PDLLM(model_dirs["deepseek"], **BASE, prefill_overrides={"engine.device": "cuda:0"},
              **{"kv_connector.options": {"connect_timeout_s": 3.0}})
    assert time.monotonic() - start < 60


def test_a_landing_zone_too_small_drops_transfers_and_the_decode_engine_recomputes(
        model_dirs: dict[str, Path]) -> None:
    """Room for 3 DeepSeek blocks (3 MLA layers x 16 tokens x 40 floats each): the prompts of 4
    blocks (67 and 64 tokens) are received and dropped, each request's blocks all or none, and
    those requests compute their prompts themselves at once (a lost block is known, not waited
    for); smaller prompts beside them in the same transfers still load."""
    prompts, params = workload("deepseek", seed=25)
    expected = [o.token_ids for o in LLM(model_dirs["deepseek"], **BASE).generate(prompts, params,
                                                                                 use_tqdm=False)]
    options = {"timeout_s": 10.0, "cpu_bytes": 3 * 3 * 16 * 40 * 4}
    with PDLLM(model_dirs["deepseek"], **BASE, **{"kv_connector.options": options}) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.kv_connector_stats()
    assert got == expected
    assert stats is not None and stats["dropped_chunks"] >= 8 and stats["loaded_chunks"] > 0
    assert stats["timed_out_loads"] == 0 and stats["failed_loads"] == 0  # lost blocks known, not waited for
