"""Four gloo ranks under torchrun (one spawn for the module): DeepSeek and Llama with tp 4 and
dcp 2 (two DCP groups holding the same KV for different heads), Llama with tp 4 (its 2 KV heads
replicated on two ranks each) and with dcp 4 (a one-token prompt leaves three ranks without
keys): greedy tokens equal to one process's and to transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import greedy_reference, write_deepseek, write_granite
from jackfield.testing.torchrun import torchrun

SEED = 4343
WORKER = Path(__file__).with_name("parallel_worker.py")
MAX_TOKENS = 3
PROMPTS = [[7], [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14]]
COMMON = {"backend": "torch_ref", "block_size": 2, "max_num_batched_tokens": 8}
JOBS = {"deepseek-tp4-dcp2": ("deepseek", {"tensor_parallel_size": 4, "dcp_size": 2}),
        "llama-tp4": ("llama", {"tensor_parallel_size": 4}),
        "llama-tp4-dcp2": ("llama", {"tensor_parallel_size": 4, "dcp_size": 2}),
        "llama-tp4-dcp4": ("llama", {"tensor_parallel_size": 4, "dcp_size": 4})}


def write(model: str, path: Path):  # type: ignore[no-untyped-def]  # noqa: ANN201 (a transformers model)
    if model == "deepseek":
        return write_deepseek("v3", path, seed=SEED)
    return write_granite(model, path, seed=SEED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, object]]]:
    print(f"seed {SEED}")
    root = tmp_path_factory.mktemp("four_ranks")
    for model in ("deepseek", "llama"):
        write(model, root / model)
    jobs = [{"name": name, "model": str(root / model), "config": {**COMMON, **parallel}, "prompts": PROMPTS,
             "max_tokens": MAX_TOKENS} for name, (model, parallel) in JOBS.items()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    torchrun(4, [str(WORKER), str(root / "jobs.json"), str(root / "out.json")], timeout_s=900)
    return root, json.loads((root / "out.json").read_text())


@pytest.mark.parametrize("name", list(JOBS))
def test_four_ranks_generate_what_one_process_does(runs: tuple[Path, dict[str, dict[str, object]]],
                                                    name: str) -> None:
    root, results = runs
    model = JOBS[name][0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in LLM(root / model, **COMMON).generate(PROMPTS, params)]
    assert results[name]["tokens"] == want and results[name]["tokens_again"] == want
    reference = write(model, root / f"hf-{name}")
    assert want == [greedy_reference(reference, prompt, MAX_TOKENS)[0] for prompt in PROMPTS]
