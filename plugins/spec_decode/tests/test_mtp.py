"""The `mtp` drafter through the engine, on tiny DeepSeek-V3 checkpoints that carry MTP layers in
DeepSeek's published layout (random weights): lossless (greedy tokens of the engine without
drafts), seeded sampling independent of the batch, every verified position in the MTP layer's
KV cache, a draft that equals the target accepted every time, the run's metrics in `jackfield
run --json`, and checkpoints without MTP layers refused before loading (also by `doctor`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.cli import main
from jackfield.config import ConfigError
from jackfield.engine.block_manager import max_request_blocks
from jackfield.testing.checkpoints import write_deepseek, write_deepseek_mtp, write_granite
from jackfield.testing.paged import PagedRun
from safetensors.torch import load_file, save_file

K = 3
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32"}
MTP = {"speculative.method": "mtp", "speculative.num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_models")
    write_deepseek_mtp("v3", root / "mtp")
    write_deepseek_mtp("v3-no-qlora-yarn", root / "mtp2", num_mtp_layers=2)
    write_deepseek_mtp("v3", root / "copycat")
    wire_mtp_to_reproduce_the_target(root / "copycat")
    write_deepseek("v3", root / "no_mtp_tensors")  # config.json says 1 MTP layer (transformers' default)
    write_granite("llama", root / "llama")
    return {p.name: p for p in root.iterdir()}


def wire_mtp_to_reproduce_the_target(directory: Path) -> None:
    """Every attention output and MLP down projection zero: the target's next token depends on
    the current one only, logits = head(norm(embed(t))). The MTP layer then passes
    h' = enorm(embed(t)) (eh_proj = [I | 0], enorm 1) through its (zeroed) decoder layer to a
    shared_head.norm equal to the target's final norm: it predicts what the target will."""
    main_file, mtp_file = directory / "model.safetensors", directory / "mtp.safetensors"
    target, mtp = load_file(str(main_file)), load_file(str(mtp_file))
    for tensors in (target, mtp):
        for name, tensor in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensor)
    layer = next(n for n in mtp if n.endswith(".eh_proj.weight")).removesuffix("eh_proj.weight")
    size = target["model.norm.weight"].shape[0]
    mtp[layer + "eh_proj.weight"] = torch.cat((torch.eye(size), torch.zeros(size, size)), dim=1)
    mtp[layer + "enorm.weight"] = torch.ones(size)
    mtp[layer + "shared_head.norm.weight"] = target["model.norm.weight"].clone()
    save_file(target, str(main_file), metadata={"format": "pt"})
    save_file(mtp, str(mtp_file))


def prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (17, 5, 2)]


@pytest.mark.parametrize("name", ["mtp", "mtp2"])
def test_greedy_tokens_equal_the_engine_without_drafts(model_dirs: dict[str, Path], name: str,
                                                       rng_seed: int) -> None:
    plain = LLM(str(model_dirs[name]), **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(str(model_dirs[name]), **BASE, **MTP)
    got = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    stats = [o.speculative for o in got]
    assert all(s is not None and s.drafts > 0 and s.draft_tokens <= K * s.drafts for s in stats)


def test_preemption_chunked_prefill_and_prefix_cache_keep_the_tokens(model_dirs: dict[str, Path],
                                                                     rng_seed: int) -> None:
    """A pool too small for the batch (preemption and recompute, drafts and lookahead in flight),
    prefill in 8-token chunks, and a second run served from the prefix cache: the same tokens."""
    directory = str(model_dirs["mtp"])
    plain = LLM(directory, **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    small = {"engine.max_num_batched_tokens": 8, "engine.block_size": 4}
    kv = LLM(directory, **BASE, **MTP, **small).engine.runner.kv
    block_bytes = sum(t.numel() * t.element_size() for t in kv.layer_caches) // kv.num_blocks
    longest = max_request_blocks(kv.groups.windows, 4, max(map(len, batch)) + GREEDY.max_tokens, 8)
    budget = (longest * 4 // 3 + 1) * block_bytes / 2**30  # the longest request fits, not all three
    tight = LLM(directory, **BASE, **MTP, **small, **{"engine.cpu_kv_cache_gib": budget})
    preempted = tight.generate(batch, GREEDY)
    assert [o.token_ids for o in preempted] == want
    assert sum(o.num_preemptions for o in preempted) > 0, "the pool was meant to be too small for the batch"
    roomy = LLM(directory, **BASE, **MTP, **small)
    assert [o.token_ids for o in roomy.generate(batch, GREEDY)] == want
    again = roomy.generate(batch, GREEDY)
    assert [o.token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("name", ["mtp", "copycat"])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model_dirs: dict[str, Path], name: str,
                                                          rng_seed: int) -> None:
    """Random MTP weights reject (nearly) every draft, the copycat's drafts are accepted: between
    them both outcomes of the rejection rule are drawn, whatever the seed."""
    spec = LLM(str(model_dirs[name]), **BASE, **MTP)
    batch = prompts(spec.engine.capabilities.vocab_size, rng_seed)
    params = SamplingParams(temperature=0.8, top_k=30, max_tokens=24, ignore_eos=True, seed=rng_seed % 1000)
    greedy_too = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = spec.generate(batch + batch[:1], [params] * len(batch) + [greedy_too])
    for prompt, output in zip(batch, together, strict=False):
        assert spec.generate([prompt], params)[0].token_ids == output.token_ids
    stats = [o.speculative for o in together if o.speculative]
    accepted, drafted = sum(s.accepted_tokens for s in stats), sum(s.draft_tokens for s in stats)
    if name == "copycat":
        assert accepted > 0
    else:
        assert drafted > accepted


def test_a_prefix_hit_gives_the_tokens_of_a_run_without_one(model_dirs: dict[str, Path],
                                                             rng_seed: int) -> None:
    """The MTP layer's KV at a block's last position read the token after it, which the block's
    hash does not cover: two prompts sharing two blocks, then differing, sample the same tokens
    with and without the other's blocks in the prefix cache."""
    directory = str(model_dirs["mtp"])
    settings = {**BASE, **MTP, "engine.block_size": 4}
    g = torch.Generator().manual_seed(rng_seed)
    shared = torch.randint(0, 200, (8,), generator=g).tolist()
    first, second = shared + [201, 202, 203], shared + [204, 205, 206]
    params = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=rng_seed % 1000 + i)
              for i in range(4)]  # a few draws: one would often not notice a stale KV entry
    alone = LLM(directory, **settings).generate([second] * 4, params)
    llm = LLM(directory, **settings)
    llm.generate([first], params[0])
    after = llm.generate([second] * 4, params)
    assert after[0].num_cached_tokens > 0
    assert [o.token_ids for o in after] == [o.token_ids for o in alone]


def test_every_verified_position_is_in_the_mtp_cache(model_dirs: dict[str, Path], rng_seed: int) -> None:
    """Mid-generation (chunked prefill, then verify steps with rejections), the MTP layer's KV at
    every computed position equals that of one pass of the layer over the request's tokens."""
    directory = str(model_dirs["mtp"])
    llm = LLM(directory, **BASE, **MTP, **{"engine.max_num_batched_tokens": 8, "engine.block_size": 4})
    engine = llm.engine
    prompt = prompts(engine.capabilities.vocab_size, rng_seed)[0]
    seq = engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=rng_seed % 1000,
                                                    ignore_eos=True))
    while seq.num_tokens < len(prompt) + 12:
        engine.step()
    # some drafts were rejected: their rows' KV was written, then overwritten
    assert seq.speculative.draft_tokens > seq.speculative.accepted_tokens
    model, layer = engine.model, engine.capabilities.num_layers
    n = seq.num_computed
    run = PagedRun(model, block_size=4, num_blocks=32)
    req = run.add()
    hidden = run.step([(req, seq.token_ids[:n])])
    with torch.no_grad():
        model.mtp_forward(0, run.context([(req, 0, n)]), torch.tensor(seq.token_ids[1 : n + 1]),
                          torch.arange(n), hidden)

    def mtp_kv(cache: torch.Tensor, table: list[int]) -> torch.Tensor:
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
        return cache.flatten(0, 1)[slots]

    got = mtp_kv(engine.runner.kv_caches[layer], seq.block_tables[0])
    torch.testing.assert_close(got, mtp_kv(run.caches[layer], run.tables[req]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_equal_to_the_target_is_always_accepted(model_dirs: dict[str, Path], temperature: float,
                                                        rng_seed: int) -> None:
    directory = str(model_dirs["copycat"])
    spec = LLM(directory, **BASE, **MTP)
    batch = prompts(spec.engine.capabilities.vocab_size, rng_seed)
    params = SamplingParams(temperature=temperature, max_tokens=48, ignore_eos=True, seed=rng_seed % 1000)
    outputs = spec.generate(batch, params)
    if temperature == 0:
        plain = LLM(directory, **BASE).generate(batch, params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    else:  # the emitted tokens follow the target's distribution (not, say, the drafts' argmax)
        assert_follows_the_bigram_target(spec, batch, outputs)
    for output in outputs:
        stats = output.speculative
        assert stats is not None and stats.drafts > 0
        # q equals p up to float32 rounding: a sampled draft is rejected with probability ~1e-6
        assert stats.accepted_tokens == stats.draft_tokens
        assert stats.mean_acceptance_length == pytest.approx(1 + stats.draft_tokens / stats.drafts)


def assert_follows_the_bigram_target(llm: LLM, prompts: list[list[int]], outputs: list) -> None:
    """The copycat target's next token depends on the current one only: over the emitted tokens,
    how often each is its predecessor's most likely successor is within 5 sigma of what
    sampling from the target gives (drafts drawn by argmax would all be)."""
    model = llm.engine.model
    with torch.no_grad():
        vocab = torch.arange(model.capabilities.vocab_size)
        probs = model.compute_logits(model.final_norm(model.embed(vocab))).softmax(dim=-1).double()
    pairs = [(seq[i - 1], seq[i]) for prompt, out in zip(prompts, outputs, strict=True)
             for seq in [prompt + out.token_ids] for i in range(len(prompt), len(seq))]
    top = torch.tensor([probs[prev].max() for prev, _ in pairs])
    hits = sum(int(probs[prev].argmax()) == token for prev, token in pairs)
    assert abs(hits - top.sum()) < 5 * (top * (1 - top)).sum().sqrt(), (hits, float(top.sum()))


def test_run_json_reports_the_mtp_drafts(model_dirs: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--model", str(model_dirs["copycat"]), "--attention-backend", "torch_ref",
            "--device", "cpu",
            "--speculative-method", "mtp", "--num-speculative-tokens", "2", "--max-tokens", "10",
            "--temperature", "0", "--prompt-token-ids", "5,6,7,8", "--json"]
    assert main(args) == 0
    spec = json.loads(capsys.readouterr().out)["summary"]["speculative"]
    assert spec["method"] == "mtp" and spec["drafts"] > 0
    assert spec["accepted_tokens"] == spec["draft_tokens"] and len(spec["accepted_per_position"]) == 2


@pytest.mark.parametrize(("name", "reason"), [
    ("no_mtp_tensors", "num_nextn_predict_layers is 1 but the checkpoint has no model.layers.3.* tensors"),
    ("llama", "only DeepseekV2ForCausalLM and DeepseekV3ForCausalLM checkpoints' MTP layers run"),
])
def test_a_checkpoint_without_mtp_layers_is_refused_before_loading(
        model_dirs: dict[str, Path], name: str, reason: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    needs = "speculative.method 'mtp' runs the checkpoint's multi-token-prediction layers"
    with pytest.raises(ConfigError) as raised:
        LLM(str(model_dirs[name]), **BASE, **MTP)
    assert needs in str(raised.value) and reason in str(raised.value)
    config = tmp_path / "jackfield.toml"
    config.write_text(f'[model]\npath = "{model_dirs[name]}"\n[attention]\nbackend = "torch_ref"\n'
                      '[engine]\ndevice = "cpu"\n[speculative]\nmethod = "mtp"\nnum_speculative_tokens = 2\n')
    assert main(["doctor", "--config", str(config)]) == 2
    out = capsys.readouterr().out
    assert needs in out and reason in out


def test_the_embedded_default_model_has_no_mtp_layers() -> None:
    with pytest.raises(ConfigError, match=r"default config.json: num_nextn_predict_layers is 0"):
        LLM(**BASE, **MTP)


def test_a_drafter_backend_is_refused_for_mtp(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"drafter_backend 'torch_ref': .*target's attention backends"):
        LLM(str(model_dirs["mtp"]), **BASE, **MTP, **{"attention.drafter_backend": "torch_ref"})


def test_a_kv_connector_or_an_fp8_cache_beside_mtp_is_refused(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"'cpu_offload' with speculative.method 'mtp' is not run yet"):
        LLM(str(model_dirs["mtp"]), **BASE, **MTP, **{"kv_connector.name": "cpu_offload"})
    with pytest.raises(ConfigError, match=r"'fp8_e4m3' with speculative.method 'mtp' is not run yet"):
        LLM(str(model_dirs["mtp"]), **BASE, **MTP, **{"attention.kv_cache_dtype": "fp8_e4m3"})
