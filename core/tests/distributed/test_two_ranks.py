"""Two gloo ranks under torchrun (one spawn for the module): greedy tokens with tensor parallel
alone, decode context parallel alone (dcp = tp) and both, equal to one process's and to
transformers', for DeepSeek (MLA, MoE), Llama and Granite MoE (with sliding windows: TP only);
prompts shorter than the DCP width (a rank with no key); KV blocks per rank = 1/dcp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import greedy_reference, write_deepseek, write_deepseek_v32, write_granite
from jackfield.testing.torchrun import torchrun

SEED = 4242
WORKER = Path(__file__).with_name("parallel_worker.py")
MAX_TOKENS = 4
# a one-token prompt (shorter than the DCP width: rank 1 holds no key at first), prompts over
# several blocks, chunked (8-token budget) beside other requests' decodes
PROMPTS = [[7], [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14], [90, 1, 56, 23, 8, 47, 11]]
# a KV budget of ~100 blocks: the budget, not max_num_seqs, sets the number of blocks
COMMON = {"backend": "torch_ref", "block_size": 2, "max_num_batched_tokens": 8, "cpu_kv_cache_gib": 1e-4}
MODELS = {"deepseek": lambda path: write_deepseek("v3", path, seed=SEED),
          "llama": lambda path: write_granite("llama", path, seed=SEED),
          "granitemoe": lambda path: write_granite("granitemoe", path, seed=SEED),
          "granitemoe_swa": lambda path: write_granite("granitemoe_swa", path, seed=SEED),
          "v32": lambda path: write_deepseek_v32(path, index_topk=4, seed=SEED)}
PARALLEL = {"tp2": {"tensor_parallel_size": 2},
            "dcp2": {"tensor_parallel_size": 2, "dcp_size": 2},
            "dcp2_interleave2": {"tensor_parallel_size": 2, "dcp_size": 2, "dcp_interleave": 2}}
FP8 = {"tensor_parallel_size": 2, "dcp_size": 2, "kv_cache_dtype": "fp8_e4m3"}  # calibrated scales
JOBS = [("deepseek", "tp2"), ("deepseek", "dcp2"), ("deepseek", "dcp2_interleave2"),
        ("llama", "tp2"), ("llama", "dcp2"), ("granitemoe", "tp2"),
        ("granitemoe_swa", "tp2"),  # sliding windows, a NoPE layer, gate ‖ up stored as one tensor
        ("v32", "tp2")]  # the indexer replicated, MLA's sparse path on each rank's heads


Runs = tuple[dict[str, Path], dict[str, torch.nn.Module], dict[str, dict[str, object]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The checkpoints, the transformers models written there, and what the two ranks generated
    for every job."""
    print(f"seed {SEED}")
    root = tmp_path_factory.mktemp("two_ranks")
    models = {name: root / name for name in MODELS}
    references = {name: write(models[name]) for name, write in MODELS.items()}
    jobs = [{"name": f"{model}-{parallel}", "model": str(models[model]),
             "config": {**COMMON, **PARALLEL[parallel]}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
            for model, parallel in JOBS]
    jobs += [{"name": f"{model}-dcp2-fp8", "model": str(models[model]), "config": {**COMMON, **FP8},
              "prompts": PROMPTS, "max_tokens": MAX_TOKENS} for model in ("deepseek", "llama")]
    (root / "jobs.json").write_text(json.dumps(jobs))
    torchrun(2, [str(WORKER), str(root / "jobs.json"), str(root / "out.json")], timeout_s=600)
    return models, references, json.loads((root / "out.json").read_text())


@pytest.mark.parametrize(("model", "parallel"), JOBS)
def test_two_ranks_generate_what_one_process_does(runs: Runs, model: str, parallel: str) -> None:
    models, references, results = runs
    result = results[f"{model}-{parallel}"]
    one = LLM(models[model], **COMMON)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in one.generate(PROMPTS, params)]
    assert result["tokens"] == want and result["tokens_again"] == want
    assert result["cached_tokens"] > 0  # the second run read the prefix cache
    assert want == [greedy_reference(references[model], prompt, MAX_TOKENS)[0] for prompt in PROMPTS]


@pytest.mark.parametrize("model", ["deepseek", "llama"])
def test_an_fp8_cache_under_dcp_generates_what_one_process_does(runs: Runs, model: str) -> None:
    """The fp8 records gathered for a prefill travel as bytes; the calibrated scales come from
    rows every rank of a DCP group computes alike."""
    models, _, results = runs
    one = LLM(models[model], **COMMON, kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert results[f"{model}-dcp2-fp8"]["tokens"] == [o.token_ids for o in one.generate(PROMPTS, params)]


@pytest.mark.parametrize("model", ["deepseek", "llama"])
def test_each_dcp_rank_holds_half_of_every_request(runs: Runs, model: str) -> None:
    """A request's prompt takes ceil(n / (B * dcp)) blocks of B slots on each rank. MLA (one
    latent record per token, the same on every TP rank): the same budget gives the same blocks,
    each covering dcp times the tokens, so the longest request doubles. GQA with KV heads split
    by TP: a DCP rank holds its DCP group's KV heads (twice tp2's), so its blocks are twice the
    size and the capacity is tp2's (DCP pays off where TP replicates KV: MLA, or tp > KV heads)."""
    _, _, results = runs
    tp, dcp = results[f"{model}-tp2"], results[f"{model}-dcp2"]
    assert dcp["tokens_per_block"] == 2 * tp["tokens_per_block"] == 2 * COMMON["block_size"]
    for result in (tp, dcp):
        assert result["blocks_after_prefill"] == -(-result["prompt_len"] // result["tokens_per_block"])
    capacity = {name: r["num_blocks"] * r["tokens_per_block"] for name, r in (("tp", tp), ("dcp", dcp))}
    if model == "deepseek":
        assert dcp["num_blocks"] == tp["num_blocks"] and capacity["dcp"] == 2 * capacity["tp"]
    else:
        assert dcp["num_blocks"] == tp["num_blocks"] // 2  # the budget's floor over blocks twice the size
