"""Hybrid models (Qwen3-Next, Granite 4.0 hybrid) through the whole engine: greedy tokens equal
transformers' with prompts over several chunks beside other requests' decodes, preempted
requests recomputed from a zero state, the recurrent metadata built once per step, and
speculative verify steps (planted rejections, n-gram lookup) rolled back to the last accepted
token with the same tokens as without drafts."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.commands.doctor import diagnose
from jackfield.config import ConfigError, resolve_config
from jackfield.contracts.drafter import DrafterOptions, DraftProposal, TokenDrafter
from jackfield.contracts.recurrent import RecurrentStateSpec
from jackfield.engine import recurrent_state
from jackfield.engine.block_manager import max_request_blocks
from jackfield.engine.recurrent_state import RecurrentStates
from jackfield.plugins import get_registry
from jackfield.testing.checkpoints import greedy_reference, write_hybrid

FAMILIES = ("qwen3_next", "granitemoehybrid")
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32",
        "engine.block_size": 4, "engine.max_num_batched_tokens": 8}
NGRAM = {"speculative.method": "ngram", "speculative.num_speculative_tokens": K,
         "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hybrid_models")
    return {name: (root / name, write_hybrid(name, root / name)) for name in FAMILIES}


def prompts(vocab: int, seed: int) -> list[list[int]]:
    """A repetitive prompt (n-gram lookup finds matches), a random one, short ones (one token:
    its first step is a decode-shaped chunk from a zero state)."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (5,), generator=g).tolist()
    return [motif * 3, torch.randint(0, vocab, (13,), generator=g).tolist(), [3, 1], [42]]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_and_prefix_caching_is_refused(
        models: dict[str, tuple[Path, torch.nn.Module]], family: str, rng_seed: int) -> None:
    path, hf_model = models[family]
    said: list[str] = []
    llm = LLM(str(path), progress=said.append, **BASE)
    assert any("prefix caching is off" in line and "recurrent layers" in line for line in said)
    batch = prompts(llm.engine.capabilities.vocab_size, rng_seed)
    for _ in range(2):  # the second run would hit the prefix cache if it were on
        outputs = llm.generate(batch, GREEDY)
        for prompt, out in zip(batch, outputs, strict=True):
            assert out.token_ids == greedy_reference(hf_model, prompt, GREEDY.max_tokens)[0]
            assert out.num_cached_tokens == 0
    assert llm.engine.block_manager.free_state_slots == list(range(llm.config.engine.max_num_seqs))[::-1]


def test_preempted_requests_recompute_their_state(models: dict[str, tuple[Path, torch.nn.Module]],
                                                  rng_seed: int) -> None:
    path, hf_model = models["granitemoehybrid"]
    kv = LLM(str(path), **BASE).engine.runner.kv
    block_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in kv.layer_caches}.values())
    block_bytes //= kv.num_blocks
    batch = prompts(97, rng_seed)
    longest = max_request_blocks(kv.groups.windows, 4, max(map(len, batch)) + GREEDY.max_tokens, 8)
    budget = (longest * 4 // 3 + 1) * block_bytes / 2**30  # the longest request fits, not all three
    tight = LLM(str(path), **BASE, **{"engine.cpu_kv_cache_gib": budget})
    outputs = tight.generate(batch, GREEDY)
    assert sum(o.num_preemptions for o in outputs) > 0, "the pool was meant to be too small for the batch"
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.token_ids == greedy_reference(hf_model, prompt, GREEDY.max_tokens)[0]


def test_recurrent_metadata_is_built_once_per_step(models: dict[str, tuple[Path, torch.nn.Module]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = models["qwen3_next"]
    llm = LLM(str(path), **BASE)
    assert len(llm.engine.model.recurrent_state_layers) == 3  # three layers share each build
    builds = []
    real = recurrent_state.recurrent_metadata

    def counting(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        builds.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(recurrent_state, "recurrent_metadata", counting)
    engine = llm.engine
    engine.add_requests([([5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14], GREEDY), ([90, 1, 56], GREEDY)])
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    assert len(builds) == steps > 2


class Oracle(TokenDrafter):
    """Proposes the reference continuation with the draft at index (known tokens mod (k + 1))
    replaced by a wrong token: verify steps accept 0, 1, 2 or all 3 drafts."""

    name = "oracle"

    def __init__(self, references: list[list[int]], vocab: int) -> None:
        super().__init__(DrafterOptions(num_speculative_tokens=K))
        self.references, self.vocab = references, vocab

    def propose(self, token_ids: Sequence[Sequence[int]]) -> DraftProposal:
        drafts = []
        for tokens in token_ids:
            reference = next(r for r in self.references if list(tokens) == r[: len(tokens)])
            draft = reference[len(tokens) : len(tokens) + K]
            planted = len(tokens) % (K + 1)
            if planted < len(draft):
                draft[planted] = (draft[planted] + 1) % self.vocab
            drafts.append(draft)
        return DraftProposal(drafts)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_steps_roll_the_state_back_to_the_last_accepted_token(
        models: dict[str, tuple[Path, torch.nn.Module]], family: str, rng_seed: int) -> None:
    path, _ = models[family]
    plain = LLM(str(path), **BASE)
    vocab = plain.engine.capabilities.vocab_size
    batch = prompts(vocab, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(str(path), **BASE, **NGRAM)
    spec.engine.drafter = Oracle([p + w for p, w in zip(batch, want, strict=True)], vocab)
    got = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    stats = [o.speculative for o in got if o.speculative is not None]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)
    assert {j for s in stats for j, n in enumerate(s.accepted_per_position) if n} == {0, 1, 2}  # every depth


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_tokens_equal_the_engine_without_drafts(
        models: dict[str, tuple[Path, torch.nn.Module]], family: str, rng_seed: int) -> None:
    path, _ = models[family]
    plain = LLM(str(path), **BASE)
    vocab = plain.engine.capabilities.vocab_size
    # A random model seldom repeats itself: take the first batch in which n-gram lookup drafts
    # (a request's newest token, before its last, occurred earlier in its tokens).
    for attempt in range(10):
        batch = prompts(vocab, rng_seed + attempt)
        want = [o.token_ids for o in plain.generate(batch, GREEDY)]
        tokens = [p + w for p, w in zip(batch, want, strict=True)]
        if any(t[i] in t[:i] for p, t in zip(batch, tokens, strict=True) for i in range(len(p), len(t) - 1)):
            break
    got = LLM(str(path), **BASE, **NGRAM).generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    assert sum(o.speculative.draft_tokens for o in got if o.speculative) > 0


def test_what_hybrid_models_do_not_run_is_refused_before_loading(
        models: dict[str, tuple[Path, torch.nn.Module]]) -> None:
    path, _ = models["qwen3_next"]
    with pytest.raises(ConfigError, match="fp8_e4m3.*Qwen3NextForCausalLM is not run yet"):
        LLM(str(path), **BASE, **{"attention.kv_cache_dtype": "fp8_e4m3"})
    with pytest.raises(ConfigError, match="cpu_offload.*Qwen3NextForCausalLM is not run yet"):
        LLM(str(path), **BASE, **{"kv_connector.name": "cpu_offload"})


def test_unsupported_layer_types_are_refused_at_selection(models: dict[str, tuple[Path, torch.nn.Module]],
                                                           tmp_path: Path) -> None:
    path, _ = models["qwen3_next"]
    shutil.copytree(path, tmp_path / "odd")
    config = json.loads((tmp_path / "odd" / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    (tmp_path / "odd" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"layer_types \['sliding_attention'\] are not supported"):
        LLM(str(tmp_path / "odd"), **BASE)


def test_doctor_says_why_the_prefix_cache_is_off(models: dict[str, tuple[Path, torch.nn.Module]]) -> None:
    path, _ = models["granitemoehybrid"]
    resolved, problems = diagnose(resolve_config(None, str(path), BASE), get_registry())
    assert not problems
    note = "enable_prefix_caching is refused for GraniteMoeHybridForCausalLM"
    assert any(note in line for line in resolved)


def test_state_kinds_and_dtypes_the_engine_cannot_keep_are_refused() -> None:
    good = RecurrentStateSpec("mamba2", 8, 4, (2, 3, 4), torch.float32)
    assert good.problems() == []
    bad = [RecurrentStateSpec("mamba2", 8, 4, (2, 3, 4), torch.float32, state_dtype=torch.bfloat16),
           RecurrentStateSpec("rwkv7", 8, 4, (2, 3, 4), torch.float32)]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16 is not supported.*'rwkv7' is not one of"):
        RecurrentStates([good, *bad], 4, torch.device("cpu"))
