"""The `dflash` drafter through the engine, on tiny targets with random DFlash drafts written in
the published layout (config.json with `dflash_config` + model.safetensors: `fc`, `hidden_norm`,
`layers.{i}.*`, `norm`): the drafts' distributions against a float64 reading of the draft's
equations over transformers' hidden states, greedy tokens equal to the engine's without drafts
(Llama, Granite, dense DeepSeek targets), seeded sampling independent of the batch, bad draft
checkpoints refused at start-up and by `jackfield doctor` naming the file and field, and an
attention backend without non-causal support refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.cli import main
from jackfield.config import ConfigError
from jackfield.engine.block_manager import max_request_blocks
from jackfield.testing.checkpoints import write_deepseek, write_granite
from jackfield_spec_decode.testing import reference_rms_norm as rms_norm
from jackfield_spec_decode.testing import reference_rope as rope
from jackfield_spec_decode.testing import write_dflash
from transformers import AutoModelForCausalLM, PreTrainedModel

K = 3
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # write_dflash's defaults


def dflash(model: Path, k: int = K, method: str = "dflash") -> dict[str, object]:
    return {"speculative.method": method, "speculative.num_speculative_tokens": k,
            "speculative.model": str(model)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash")
    write_granite("llama", root / "llama")
    write_granite("granite", root / "granite")
    write_deepseek("v3", root / "deepseek", first_k_dense_replace=3)  # every layer dense
    write_dflash(root / "draft", root / "llama", 1, target_layer_ids=[0, 2], mask_token_id=96)
    write_dflash(root / "draft_granite", root / "granite", 2, target_layer_ids=[1], mask_token_id=3,
                 layers=1)
    write_dflash(root / "draft_deepseek", root / "deepseek", 3, target_layer_ids=[1, 0], mask_token_id=7)
    write_dflash(root / "spark", root / "llama", 4, target_layer_ids=[0, 2], mask_token_id=96, markov_rank=8)
    write_dflash(root / "spark_granite", root / "granite", 5, target_layer_ids=[-1, 1], mask_token_id=3,
                 markov_rank=4, layers=1)
    write_dflash(root / "spark_deepseek", root / "deepseek", 6, target_layer_ids=[1], mask_token_id=7,
                 markov_rank=8)
    return {p.name: p for p in root.iterdir()}


def prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (17, 5, 2)]


# ---- the draft's equations in float64 --------------------------------------------------------

def key_value(w: dict[str, torch.Tensor], p: str, h: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `p`'s keys (k_norm, then RoPE) and values of rows `h`."""
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(len(h), KV_HEADS, HEAD_DIM)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(len(h), KV_HEADS, HEAD_DIM)
    return rope(rms_norm(k, w[p + "self_attn.k_norm.weight"]), positions), v


def reference_draft_probabilities(target: PreTrainedModel, tensors: dict[str, torch.Tensor],
                                  layer_ids: list[int], mask_token_id: int, tokens: list[int],
                                  drafts: list[int], temperature: float,
                                  dspark: bool = False) -> torch.Tensor:
    """q [len(drafts), vocab] after `tokens` (the prompt and the first sampled token): the context
    from one transformers forward over the prompt (hidden_states[i + 1]: layer i's output), then
    one non-causal block attending it: DFlash's [newest token, MASK x d] (row j + 1 drafts j), or
    DSpark's [newest token, MASK x (d - 1)] (row j drafts j, its logits plus the Markov bias of
    the token before it: the newest token, then the drafts)."""
    w = {name: t.double() for name, t in tensors.items()}
    num_drafts = len(drafts)
    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    context = rms_norm(torch.cat([states[i + 1][0].double() for i in layer_ids], -1) @ w["fc.weight"].T,
                       w["hidden_norm.weight"])
    n, extra = len(tokens), 0 if dspark else 1
    block = [tokens[-1]] + [mask_token_id] * (num_drafts - 1 + extra)
    x = target.get_input_embeddings().weight.double()[block]
    context_positions, block_positions = torch.arange(n - 1), torch.arange(n - 1, n - 1 + len(block))
    num_layers = sum(1 for name in w if name.endswith("input_layernorm.weight"))
    for i in range(num_layers):
        p = f"layers.{i}."

        a = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(len(a), HEADS, HEAD_DIM)
        q = rope(rms_norm(q, w[p + "self_attn.q_norm.weight"]), block_positions)
        context_k, context_v = key_value(w, p, context, context_positions)
        block_k, block_v = key_value(w, p, a, block_positions)
        keys = torch.cat((context_k, block_k)).repeat_interleave(HEADS // KV_HEADS, dim=1)
        values = torch.cat((context_v, block_v)).repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("thd,phd->htp", q, keys) * HEAD_DIM**-0.5  # every key: non-causal
        attn = torch.einsum("htp,phd->thd", scores.softmax(-1), values)
        x = x + attn.reshape(len(x), -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = rms_norm(x[extra:], w["norm.weight"])
    logits = out @ target.get_output_embeddings().weight.double().T
    if dspark:
        previous = [tokens[-1], *drafts[:-1]]
        logits = logits + w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T
    return (logits / temperature).softmax(-1)


@pytest.mark.parametrize(("method", "temperature"), [("dflash", 1.0), ("dflash", 0.7), ("dspark", 1.0),
                                                     ("dspark", 0.7)])
def test_draft_distributions_match_a_float64_reference(dirs: dict[str, Path], tmp_path: Path, method: str,
                                                       temperature: float, rng_seed: int) -> None:
    layer_ids = [2, 0, -1]  # not sorted: fc's columns follow the config's order; -1: the embedding
    g = torch.Generator().manual_seed(rng_seed)
    mask = int(torch.randint(0, 97, (1,), generator=g))
    print(f"seed {rng_seed}: mask_token_id {mask}")
    tensors = write_dflash(tmp_path / "draft", dirs["llama"], rng_seed, target_layer_ids=layer_ids,
                           mask_token_id=mask, markov_rank=8 if method == "dspark" else 0)
    target = AutoModelForCausalLM.from_pretrained(dirs["llama"]).double().eval()
    engine = LLM(str(dirs["llama"]), **BASE, **dflash(tmp_path / "draft", method=method)).engine
    for prompt in prompts(engine.capabilities.vocab_size, rng_seed):
        seq = engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=8,
                                                        seed=rng_seed % 1000, ignore_eos=True))
        engine.step()  # the prefill: the first token, then K drafts
        assert len(seq.draft_ids) == K and seq.draft_probs is not None
        want = reference_draft_probabilities(target, tensors, layer_ids, mask, seq.token_ids, seq.draft_ids,
                                             temperature, dspark=method == "dspark")
        torch.testing.assert_close(seq.draft_probs.double(), want, atol=2e-6, rtol=1e-4)
        while seq.finish_time is None:
            engine.step()


@pytest.mark.parametrize(("target", "draft", "method"), [
    ("llama", "draft", "dflash"), ("granite", "draft_granite", "dflash"),
    ("deepseek", "draft_deepseek", "dflash"), ("llama", "spark", "dspark"),
    ("granite", "spark_granite", "dspark"), ("deepseek", "spark_deepseek", "dspark"),
])
def test_greedy_tokens_equal_the_engine_without_drafts(dirs: dict[str, Path], target: str, draft: str,
                                                       method: str, rng_seed: int) -> None:
    plain = LLM(str(dirs[target]), **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    got = LLM(str(dirs[target]), **BASE, **dflash(dirs[draft], method=method)).generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    assert all(o.speculative is not None and o.speculative.drafts > 0 for o in got)


@pytest.mark.parametrize(("draft", "method"), [("draft", "dflash"), ("spark", "dspark")])
def test_preemption_chunked_prefill_and_prefix_cache_keep_the_tokens(dirs: dict[str, Path], draft: str,
                                                                     method: str, rng_seed: int) -> None:
    """Prefill in 8-token chunks; a pool too small for the batch (preemption and recompute with
    drafts and the block's lookahead in flight); a second run served from the prefix cache."""
    directory = str(dirs["llama"])
    plain = LLM(directory, **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    small = {**BASE, **dflash(dirs[draft], method=method), "engine.max_num_batched_tokens": 8,
             "engine.block_size": 4}
    spec = LLM(directory, **small)
    assert [o.token_ids for o in spec.generate(batch, GREEDY)] == want
    again = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in again] == want and sum(o.num_cached_tokens for o in again) > 0
    kv = spec.engine.runner.kv
    block_bytes = sum(t.numel() * t.element_size() for t in kv.layer_caches) // kv.num_blocks
    longest = max_request_blocks(kv.groups.windows, 4, max(map(len, batch)) + GREEDY.max_tokens, 8)
    budget = (longest * 4 // 3 + 1) * block_bytes / 2**30  # the longest request fits, not all three
    preempted = LLM(directory, **small, **{"engine.cpu_kv_cache_gib": budget}).generate(batch, GREEDY)
    assert [o.token_ids for o in preempted] == want
    assert sum(o.num_preemptions for o in preempted) > 0, "the pool was meant to be too small for the batch"


@pytest.mark.parametrize(("draft", "method"), [("draft", "dflash"), ("spark", "dspark")])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(dirs: dict[str, Path], draft: str, method: str,
                                                          rng_seed: int) -> None:
    spec = LLM(str(dirs["llama"]), **BASE, **dflash(dirs[draft], method=method))
    batch = prompts(spec.engine.capabilities.vocab_size, rng_seed)
    params = SamplingParams(temperature=0.8, top_k=30, max_tokens=24, ignore_eos=True, seed=rng_seed % 1000)
    greedy_too = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = spec.generate(batch + batch[:1], [params] * len(batch) + [greedy_too])
    for prompt, output in zip(batch, together, strict=False):
        assert spec.generate([prompt], params)[0].token_ids == output.token_ids
    assert sum(o.speculative.draft_tokens for o in together if o.speculative) > 0


def test_run_json_reports_the_dflash_drafts(dirs: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--model", str(dirs["llama"]), "--attention-backend", "torch_ref", "--device", "cpu",
            "--speculative-method", "dflash", "--speculative-model", str(dirs["draft"]),
            "--num-speculative-tokens", "2", "--max-tokens", "10", "--temperature", "0",
            "--prompt-token-ids", "5,6,7,8", "--json"]
    assert main(args) == 0
    spec = json.loads(capsys.readouterr().out)["summary"]["speculative"]
    assert spec["method"] == "dflash" and spec["drafts"] > 0 and len(spec["accepted_per_position"]) == 2


@pytest.mark.parametrize(("case", "reason"), [
    ("missing", "speculative.model {dir}: no such directory"),
    ("hidden", "{dir}/config.json: hidden_size 48 differs from the target model's 32"),
    ("vocab", "{dir}/config.json: vocab_size 98 differs from the target model's 97"),
    ("architecture", "{dir}/config.json: architectures ['LlamaForCausalLM'] is not a dflash draft model "
                     "(DFlashDraftModel)"),
    ("layer_ids", "{dir}/config.json: dflash_config.target_layer_ids [0, 3] must name distinct layers of "
                  "the target's 4 whose outputs feed a further layer (0 .. 2; -1: the embedding)"),
    ("mask", "{dir}/config.json: dflash_config.mask_token_id 97 must be a token id of the target's "
             "vocabulary"),
    ("causal", "{dir}/config.json: is_causal is true"),
    ("sliding", "{dir}/config.json: sliding-window layers"),
    ("target_layers", "{dir}/config.json: num_target_layers 36 differs from the target model's 4"),
    ("no_files", "{dir}: no *.safetensors files"),
])
def test_bad_draft_checkpoints_are_refused_before_loading(
        dirs: dict[str, Path], tmp_path: Path, case: str, reason: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / case
    if case != "missing":
        settings: dict[str, object] = {"target_layer_ids": [0, 2], "mask_token_id": 9}
        overrides: dict[str, object] = {
            "hidden": {"hidden_size": 48}, "vocab": {"vocab_size": 98},
            "architecture": {"architectures": ["LlamaForCausalLM"]},
            "layer_ids": {}, "mask": {}, "causal": {"is_causal": True},
            "sliding": {"layer_types": ["sliding_attention", "full_attention"]},
            "target_layers": {"num_target_layers": 36}, "no_files": {},
        }[case]
        settings |= {"layer_ids": {"target_layer_ids": [0, 3]}, "mask": {"mask_token_id": 97}}.get(case, {})
        write_dflash(directory, dirs["llama"], 7, **settings, **overrides)  # type: ignore[arg-type]
        if case == "no_files":
            (directory / "model.safetensors").unlink()
    reason = reason.format(dir=directory)
    with pytest.raises(ConfigError) as raised:
        LLM(str(dirs["llama"]), **BASE, **dflash(directory))
    assert f"speculative.method 'dflash': {reason}" in str(raised.value)
    config = tmp_path / "jackfield.toml"
    config.write_text(f'[model]\npath = "{dirs["llama"]}"\n[attention]\nbackend = "torch_ref"\n'
                      '[engine]\ndevice = "cpu"\n[speculative]\nmethod = "dflash"\n'
                      f'num_speculative_tokens = 2\nmodel = "{directory}"\n')
    assert main(["doctor", "--config", str(config)]) == 2
    assert reason in capsys.readouterr().out


def test_a_block_too_small_for_k_is_refused(dirs: dict[str, Path], tmp_path: Path) -> None:
    write_dflash(tmp_path / "draft", dirs["llama"], 7, target_layer_ids=[1], mask_token_id=9, block_size=3)
    too_small = r"dflash_config.block_size 3 is too small for num_speculative_tokens 3"
    with pytest.raises(ConfigError, match=too_small):
        LLM(str(dirs["llama"]), **BASE, **dflash(tmp_path / "draft"))


def test_no_draft_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"speculative.model: dflash drafts with a draft checkpoint"):
        LLM(**BASE, **{"speculative.method": "dflash", "speculative.num_speculative_tokens": 2})


def test_a_backend_without_non_causal_support_is_refused_naming_it(dirs: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str, int]] = []

    def causal_only(device: torch.device | str, kv_cache_dtype: str = "auto", query_len: int = 1) -> bool:
        asked.append((str(device), kv_cache_dtype, query_len))
        return False

    monkeypatch.setattr(TorchRefBackend, "supports_non_causal", staticmethod(causal_only))
    with pytest.raises(ConfigError, match=r"attends its block of 4 rows non-causally; the attention backend "
                                          r"'torch_ref' does not on cpu with kv_cache_dtype 'auto'"):
        LLM(str(dirs["llama"]), **BASE, **dflash(dirs["draft"]))
    assert ("cpu", "auto", K + 1) in asked


def test_a_drafter_backend_kv_connector_or_fp8_cache_beside_dflash_is_refused(dirs: dict[str, Path]) -> None:
    settings = {**BASE, **dflash(dirs["draft"])}
    with pytest.raises(ConfigError, match=r"drafter_backend 'torch_ref': .*target's attention backends"):
        LLM(str(dirs["llama"]), **settings, **{"attention.drafter_backend": "torch_ref"})
    with pytest.raises(ConfigError, match=r"'fp8_e4m3' with speculative.method 'dflash' is not run yet"):
        LLM(str(dirs["llama"]), **settings, **{"attention.kv_cache_dtype": "fp8_e4m3"})


@pytest.mark.parametrize(("case", "reason"), [
    ("architecture", "{dir}/config.json: architectures ['DFlashDraftModel'] is not a dspark draft model "
                     "(Qwen3DSparkModel or DSparkDraftModel)"),
    ("head_type", "{dir}/config.json: markov_head_type 'gated' is not run"),
    ("rank", "{dir}/config.json: markov_rank must be an integer >= 1, got None"),
    ("block", "{dir}/config.json: block_size 1 is too small for num_speculative_tokens 2"),
])
def test_bad_dspark_checkpoints_are_refused(dirs: dict[str, Path], tmp_path: Path, case: str, reason: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / case
    overrides: dict[str, object] = {
        "architecture": {"architectures": ["DFlashDraftModel"]}, "head_type": {"markov_head_type": "gated"},
        "rank": {}, "block": {"block_size": 1},
    }[case]
    write_dflash(directory, dirs["llama"], 7, target_layer_ids=[0, 2], mask_token_id=9, markov_rank=4,
                 **overrides)  # type: ignore[arg-type]
    if case == "rank":
        data = json.loads((directory / "config.json").read_text())
        del data["markov_rank"]
        (directory / "config.json").write_text(json.dumps(data))
    reason = reason.format(dir=directory)
    with pytest.raises(ConfigError) as raised:
        LLM(str(dirs["llama"]), **BASE, **dflash(directory, k=2, method="dspark"))
    assert f"speculative.method 'dspark': {reason}" in str(raised.value)
    if case == "block":  # k is known at start-up only
        return
    config = tmp_path / "jackfield.toml"
    config.write_text(f'[model]\npath = "{dirs["llama"]}"\n[attention]\nbackend = "torch_ref"\n'
                      '[engine]\ndevice = "cpu"\n[speculative]\nmethod = "dspark"\n'
                      f'num_speculative_tokens = 2\nmodel = "{directory}"\n')
    assert main(["doctor", "--config", str(config)]) == 2
    assert reason in capsys.readouterr().out
