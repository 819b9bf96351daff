"""The `eagle3` drafter through the engine, on tiny targets with random EAGLE-3 heads written in
the published layout (config.json + model.safetensors: `fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`): the drafts' distributions against a float64 reading of the head's equations over
transformers' hidden states, greedy tokens equal to the engine's without drafts (Llama, Granite,
dense DeepSeek targets), seeded sampling independent of the batch, and bad draft checkpoints
refused at start-up and by `jackfield doctor`, naming the file and field."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.cli import main
from jackfield.config import ConfigError
from jackfield.engine.block_manager import max_request_blocks
from jackfield.testing.checkpoints import write_deepseek, write_granite
from jackfield_spec_decode.testing import OracleStep, check_oracle_steps, oracle_drafts, write_eagle3
from jackfield_spec_decode.testing import reference_rms_norm as rms_norm
from jackfield_spec_decode.testing import reference_rope as rope
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

K = 3
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # write_eagle3's defaults




def eagle3(model: Path, k: int = K) -> dict[str, object]:
    return {"speculative.method": "eagle3", "speculative.num_speculative_tokens": k,
            "speculative.model": str(model)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    write_granite("llama", root / "llama")
    write_granite("granite", root / "granite")
    write_granite("llama", root / "llama8", num_hidden_layers=8)
    write_deepseek("v3", root / "deepseek", first_k_dense_replace=3)  # every layer dense
    write_eagle3(root / "head", root / "llama", 1, taps=[1, 2, 3])
    write_eagle3(root / "head_d2t", root / "llama", 2, taps=[1, 2, 3], draft_vocab=40)
    write_eagle3(root / "head_granite", root / "granite", 3, taps=[0, 1, 3], draft_vocab=50)
    write_eagle3(root / "head_default_taps", root / "llama8", 4, taps=None)
    write_eagle3(root / "head_deepseek", root / "deepseek", 5, taps=[0, 1, 2], draft_vocab=100)
    return {p.name: p for p in root.iterdir()}


def prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (17, 5, 2)]


def record_drafts(runner: Any) -> list[object]:
    """Wraps the runner's drafting so that every phase's output is appended to the list returned."""
    inner, seen = runner._draft, []

    def recorded(*args: object) -> object:
        out = inner(*args)
        seen.append(out)
        return out

    runner._draft = recorded
    return seen


# ---- the head's equations in float64 ---------------------------------------------------------

class ReferenceHead:
    """The head over one request, float64, its KV kept per position."""

    def __init__(self, tensors: dict[str, torch.Tensor], embedding: torch.Tensor, vocab: int,
                 norm_before_residual: bool) -> None:
        self.w = {name: t.double() for name, t in tensors.items() if name not in ("d2t", "t2d")}
        self.embedding, self.vocab, self.norm_before_residual = embedding, vocab, norm_before_residual
        self.d2t = tensors["d2t"]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def layer(self, token_ids: list[int], hidden: torch.Tensor, first_position: int) -> torch.Tensor:
        w, m = self.w, "midlayer."
        positions = torch.arange(first_position, first_position + len(token_ids))
        normed = rms_norm(hidden, w[m + "hidden_norm.weight"])
        z = torch.cat((rms_norm(self.embedding[token_ids], w[m + "input_layernorm.weight"]), normed), -1)
        t = len(token_ids)
        q = rope((z @ w[m + "self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM), positions)
        k = rope((z @ w[m + "self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM), positions)
        v = (z @ w[m + "self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
        self.keys += list(k)
        self.values += list(v)
        keys = torch.stack(self.keys).repeat_interleave(HEADS // KV_HEADS, dim=1)  # [P, heads, d]
        values = torch.stack(self.values).repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("thd,phd->htp", q, keys) * HEAD_DIM**-0.5
        visible = torch.arange(len(self.keys))[None, :] <= positions[:, None]
        attn = torch.einsum("htp,phd->thd", scores.masked_fill(~visible, -torch.inf).softmax(-1), values)
        residual = normed if self.norm_before_residual else hidden
        r = attn.reshape(t, -1) @ w[m + "self_attn.o_proj.weight"].T + residual
        x = rms_norm(r, w[m + "post_attention_layernorm.weight"])
        gate, up = x @ w[m + "mlp.gate_proj.weight"].T, x @ w[m + "mlp.up_proj.weight"].T
        mlp = torch.nn.functional.silu(gate) * up
        return r + mlp @ w[m + "mlp.down_proj.weight"].T

    def probabilities(self, out: torch.Tensor) -> torch.Tensor:
        """[vocab] of one row's output: the draft vocabulary's softmax placed at i + d2t[i]."""
        draft = (rms_norm(out, self.w["norm.weight"]) @ self.w["lm_head.weight"].T).softmax(-1)
        full = torch.zeros(self.vocab, dtype=torch.float64)
        full[torch.arange(len(self.d2t)) + self.d2t] = draft
        return full


def reference_draft_probabilities(target: PreTrainedModel, head: ReferenceHead, taps: list[int],
                                  tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """q of each draft after `tokens` (the prompt and the first sampled token): taps from one
    transformers forward over the prompt (hidden_states[i]: layer i's input), then the head over
    the verified rows, then one row per further draft fed the previous output."""
    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    fused = torch.cat([states[i][0].double() for i in taps], -1) @ head.w["fc.weight"].T
    out = head.layer(tokens[1:], fused, 0)[-1:]
    probs = [head.probabilities(out[0])]
    for j, token in enumerate(drafts[:-1]):
        out = head.layer([token], out, len(tokens) - 1 + j)
        probs.append(head.probabilities(out[0]))
    return probs


@pytest.mark.parametrize(("name", "settings"), [
    ("equal_vocab", {}),
    ("d2t", {"draft_vocab": 40}),
    ("own_embedding_norm_before_residual", {"own_embedding": True, "norm_before_residual": True}),
])
def test_draft_distributions_match_a_float64_reference(dirs: dict[str, Path], tmp_path: Path, name: str,
                                                       settings: dict[str, object], rng_seed: int) -> None:
    taps = [3, 1, 2]  # not sorted: fc's columns follow the config's order
    tensors = write_eagle3(tmp_path / name, dirs["llama"], rng_seed, taps=taps, **settings)  # type: ignore[arg-type]
    target = AutoModelForCausalLM.from_pretrained(dirs["llama"]).double().eval()
    llm = LLM(str(dirs["llama"]), **BASE, **eagle3(tmp_path / name))
    engine = llm.engine
    vocab = engine.capabilities.vocab_size
    embedding = tensors.get("embed_tokens.weight", target.get_input_embeddings().weight).double()
    for prompt in prompts(vocab, rng_seed):
        seq = engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=rng_seed % 1000,
                                                        ignore_eos=True))
        engine.step()  # the prefill: the first token, then K drafts
        assert len(seq.draft_ids) == K and seq.draft_probs is not None
        head = ReferenceHead(tensors, embedding, vocab, bool(settings.get("norm_before_residual")))
        want = reference_draft_probabilities(target, head, taps, seq.token_ids, seq.draft_ids)
        for got, expected in zip(seq.draft_probs, want, strict=True):
            torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-4)
        if "draft_vocab" in settings:  # drafts come from the draft vocabulary only
            allowed = set((torch.arange(40) + tensors["d2t"]).tolist())
            assert set(seq.draft_ids) <= allowed
        while seq.finish_time is None:
            engine.step()


@pytest.mark.parametrize(("target", "head"), [
    ("llama", "head"), ("llama", "head_d2t"), ("granite", "head_granite"), ("llama8", "head_default_taps"),
    ("deepseek", "head_deepseek"),
])
def test_greedy_tokens_equal_the_engine_without_drafts(dirs: dict[str, Path], target: str, head: str,
                                                       rng_seed: int) -> None:
    plain = LLM(str(dirs[target]), **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    got = LLM(str(dirs[target]), **BASE, **eagle3(dirs[head])).generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    assert all(o.speculative is not None and o.speculative.drafts > 0 for o in got)


def test_preemption_chunked_prefill_and_prefix_cache_keep_the_tokens(dirs: dict[str, Path],
                                                                     rng_seed: int) -> None:
    """Prefill in 8-token chunks; a pool too small for the batch (preemption and recompute with
    drafts and the head's lookahead in flight); a second run served from the prefix cache."""
    directory = str(dirs["llama"])
    plain = LLM(directory, **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    small = {**BASE, **eagle3(dirs["head_d2t"]), "engine.max_num_batched_tokens": 8, "engine.block_size": 4}
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


def test_piecewise_pieces_hand_the_drafter_the_eager_taps(dirs: dict[str, Path], rng_seed: int) -> None:
    """The piecewise path (its pieces run unrecorded over the same static buffers, as a replay
    does) gives the drafter the layer inputs the eager forward does: the same drafts, drawn from
    the same distributions, step after step."""
    from jackfield.engine.piecewise_graphs import PiecewiseGraphs

    settings = {**BASE, **eagle3(dirs["head"]), "engine.max_num_batched_tokens": 48}
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=rng_seed % 1000)

    def drafts(llm: LLM, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        engine = llm.engine
        seq = engine.add_request(prompt, params)
        probs = []
        while seq.finish_time is None:
            engine.step()
            if seq.draft_probs is not None:
                probs.append(seq.draft_probs.clone())
        return seq.token_ids, probs

    eager = LLM(str(dirs["llama"]), **settings)
    replayed = LLM(str(dirs["llama"]), **settings)
    pieces = PiecewiseGraphs(replayed.engine.model, 48, replayed.engine.device, record=False)
    pieces.capture()
    replayed.engine.runner.pieces = pieces
    for prompt in prompts(eager.engine.capabilities.vocab_size, rng_seed):
        want_tokens, want = drafts(eager, prompt)
        got_tokens, got = drafts(replayed, prompt)
        assert got_tokens == want_tokens and len(got) == len(want) > 0
        for g, w in zip(got, want, strict=True):
            # float32 products of a padded piece and of the eager rows may take different GEMM
            # kernels (oneDNN's packed weight from 4 rows on): probabilities a few 1e-6 apart
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


def test_run_json_reports_the_eagle3_drafts(dirs: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--model", str(dirs["llama"]), "--attention-backend", "torch_ref", "--device", "cpu",
            "--speculative-method", "eagle3", "--speculative-model", str(dirs["head"]),
            "--num-speculative-tokens", "2", "--max-tokens", "10", "--temperature", "0",
            "--prompt-token-ids", "5,6,7,8", "--json"]
    assert main(args) == 0
    spec = json.loads(capsys.readouterr().out)["summary"]["speculative"]
    assert spec["method"] == "eagle3" and spec["drafts"] > 0 and len(spec["accepted_per_position"]) == 2


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(dirs: dict[str, Path], rng_seed: int) -> None:
    spec = LLM(str(dirs["llama"]), **BASE, **eagle3(dirs["head_d2t"]))
    batch = prompts(spec.engine.capabilities.vocab_size, rng_seed)
    params = SamplingParams(temperature=0.8, top_k=30, max_tokens=24, ignore_eos=True, seed=rng_seed % 1000)
    greedy_too = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = spec.generate(batch + batch[:1], [params] * len(batch) + [greedy_too])
    for prompt, output in zip(batch, together, strict=False):
        assert spec.generate([prompt], params)[0].token_ids == output.token_ids
    assert sum(o.speculative.draft_tokens for o in together if o.speculative) > 0


def test_the_chain_metadata_in_one_pass_drafts_as_a_pass_per_draft(dirs: dict[str, Path],
                                                                     rng_seed: int) -> None:
    """The model runner makes the rows of every draft of a chain in one metadata pass, sliced per
    draft (requests near max_tokens stop drafting early, so the slices differ in size); a pass per
    draft (its DCP path) must draw the same drafts with the same probabilities."""
    def drafts(per_draft: bool) -> list[object]:
        llm = LLM(str(dirs["llama"]), **BASE, **eagle3(dirs["head_d2t"], k=4))
        runner = llm.engine.runner
        if per_draft:
            runner._draft_chain_attention = lambda chain: [functools.partial(runner._draft_attention, spans,
                                                                             len(spans)) for spans in chain]
        seen = record_drafts(runner)
        batch = prompts(llm.engine.capabilities.vocab_size, rng_seed)
        params = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True, seed=rng_seed % 1000 + n)
                  for n in (9, 12, 14)]
        llm.generate(batch, params)
        return seen

    one_pass, per_draft = drafts(False), drafts(True)
    assert len(one_pass) == len(per_draft)
    lengths = set()
    for got, want in zip(one_pass, per_draft, strict=True):
        for (got_ids, got_q), (want_ids, want_q) in zip(got, want, strict=True):
            assert got_ids == want_ids
            assert (got_q is None) == (want_q is None)
            assert got_q is None or torch.equal(got_q, want_q)
        lengths.add(tuple(len(ids) for ids, _ in got))
    assert any(len(set(step)) > 1 for step in lengths), "no step whose requests drafted different counts"


def unrecorded_graphs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Decode and drafting graphs of record=False in place of the runner's (the CPU has none): the
    replays' data flow over their static buffers (q rows a request padded to the batch size, rows
    that write no KV). Returns the list of each drafting replay's q."""
    import dataclasses

    import jackfield.attention.torch_ref
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.engine.draft_graphs import DraftGraphs

    # torch_ref reads each request's length on the host, where a replay's metadata holds upper
    # bounds (a graph backend reads the device lengths): on the CPU the static length buffer is a
    # host tensor, so torch_ref gets it as its host lengths, and skips its checks, which refuse
    # the padding requests' rows of no length
    static_metadata = DecodeGraphs.static_metadata

    def with_static_lengths(graphs: DecodeGraphs, *args: Any, **kwargs: Any) -> list[object]:
        metadata = static_metadata(graphs, *args, **kwargs)
        return [dataclasses.replace(m, seq_lens_cpu=m.seq_lens) for m in metadata]

    monkeypatch.setattr(DecodeGraphs, "static_metadata", with_static_lengths)
    monkeypatch.setattr(jackfield.attention.torch_ref, "check_attend_inputs", lambda *args: None)
    engine, runner = llm.engine, llm.engine.runner
    decode = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, runner.block_size,
                          engine.max_model_len, engine.config.engine.max_num_seqs, engine.device,
                          query_lens=(1, 1 + K), tap_layers=runner.tap_layers, record=False)
    decode.capture()
    graphs = DraftGraphs(decode, runner.drafter, runner.sampler, engine.capabilities.vocab_size,
                         runner.draft_limits, record=False)
    graphs.capture()
    replays: list[int] = []
    run, run_greedy = graphs.run, graphs.run_greedy

    def counted(chunks, q, emitted):  # type: ignore[no-untyped-def]
        replays.append(q)
        return run(chunks, q, emitted)

    def counted_greedy(chunks, q, tokens):  # type: ignore[no-untyped-def]
        replays.append(q)
        return run_greedy(chunks, q, tokens)

    graphs.run, graphs.run_greedy = counted, counted_greedy  # type: ignore[method-assign]
    runner.graphs, runner.draft_graphs = decode, graphs
    return replays


def test_the_drafting_graphs_draft_as_the_eager_chain(dirs: dict[str, Path], rng_seed: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's drafting as its CUDA graphs replay it (record=False: the same drafting over
    the static buffers, after decode graphs of record=False: q rows a request padded to the batch
    size, rows that write no KV, requests that stop drafting early, all-greedy and drawn batches)
    gives the eager chain's drafts and probabilities, step after step."""
    settings = {**BASE, **eagle3(dirs["head_d2t"]), "engine.block_size": 4, "engine.max_num_seqs": 4}
    print(f"seed={rng_seed}")

    def drafts(replayed: bool) -> tuple[list[object], list[list[int]], list[int]]:
        llm = LLM(str(dirs["llama"]), **settings)
        replays = unrecorded_graphs(llm, monkeypatch) if replayed else []
        seen = record_drafts(llm.engine.runner)
        batch = prompts(llm.engine.capabilities.vocab_size, rng_seed)
        drawn = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True, seed=rng_seed % 1000 + n)
                 for n in (9, 12)] + [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)]
        greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 13, 7)]
        tokens = [o.token_ids for params in (drawn, greedy) for o in llm.generate(batch, params)]
        return seen, tokens, replays

    (want, want_tokens, _), (got, got_tokens, replays) = drafts(False), drafts(True)
    assert {1, 1 + K} <= set(replays), replays  # steps after all drafts rejected, and after accepted ones
    drew = stopped_early = 0
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=False)):
        for (got_ids, got_q), (want_ids, want_q) in zip(got_step, want_step, strict=True):  # type: ignore[call-overload]
            assert got_ids == want_ids, (step, got_step, want_step)
            assert (got_q is None) == (want_q is None)
            if got_q is not None:
                # a padded batch's GEMMs may take other float32 kernels than the eager rows'
                torch.testing.assert_close(got_q, want_q, atol=2e-5, rtol=1e-4)
                drew += 1
        stopped_early += len({len(ids) for ids, _ in got_step}) > 1  # type: ignore[attr-defined]
    assert len(got) == len(want) and got_tokens == want_tokens
    assert drew and stopped_early, (drew, stopped_early)


def test_greedy_acceptance_on_the_device_drafts_as_the_eager_chain(dirs: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain greedy step replayed with drafting graphs counts each request's accepted drafts on
    the device and reads its tokens and drafts back together (`DraftGraphs.run_greedy`): the same
    new tokens and drafts as the eager chain, step after step, over batches whose requests accept
    every count (`oracle_drafts`); requests near their max_tokens may draft fewer. The prompts
    are fixed: most fall into a loop of one token (this tiny target's), where a request with
    fewer drafts has padding rows equal to its next token, which only its own draft count keeps
    from counting as accepted."""
    settings = {**BASE, **eagle3(dirs["head_d2t"]), "engine.block_size": 4, "engine.max_num_seqs": 4}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 14, 17, 11)]
    vocab = 97
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (17, 5, 2, 9)]
    reference = [o.token_ids for o in LLM(str(dirs["llama"]), **BASE).generate(batch, params)]

    def steps(fused: bool) -> tuple[list[OracleStep], list[list[int]], list[int]]:
        llm = LLM(str(dirs["llama"]), **settings)
        assert llm.engine.capabilities.vocab_size == vocab
        replays = unrecorded_graphs(llm, monkeypatch) if fused else []
        seen = oracle_drafts(llm.engine.runner, batch, reference, vocab)
        return seen, [o.token_ids for o in llm.generate(batch, params)], replays

    (want, want_tokens, _), (got, got_tokens, replays) = steps(False), steps(True)
    assert got == want and got_tokens == want_tokens == reference
    assert replays.count(1 + K) >= 5, replays
    check_oracle_steps(got, K)
    # a request of fewer drafts than q - 1, every one accepted, its bonus its last draft's token
    # (that of its padding rows): counted past its own drafts, its padding rows would be accepted
    assert any(0 < d == len(new) - 1 < q - 1 and new[-1] == new[-2] for step in got for d, q, new, _ in step)


@pytest.mark.parametrize(("case", "reason"), [
    ("missing", "speculative.model {dir}: no such directory"),
    ("hidden", "{dir}/config.json: hidden_size 48 differs from the target model's 32"),
    ("vocab", "{dir}/config.json: vocab_size 98 differs from the target model's 97"),
    ("architecture", "{dir}/config.json: architectures ['LlamaForCausalLM'] is not an EAGLE-3 draft head"),
    ("taps", "{dir}/config.json: eagle_config.eagle_aux_hidden_state_layer_ids [1, 2, 4] must name three "
             "distinct layers of the target's 4"),
    ("default_taps", "{dir}/config.json: the target's 4 layers give no three distinct default tap layers"),
    ("no_files", "{dir}: no *.safetensors files"),
])
def test_bad_draft_checkpoints_are_refused_before_loading(
        dirs: dict[str, Path], tmp_path: Path, case: str, reason: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / case
    if case != "missing":
        overrides: dict[str, object] = {
            "hidden": {"hidden_size": 48}, "vocab": {"vocab_size": 98},
            "architecture": {"architectures": ["LlamaForCausalLM"]},
            "taps": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}},
            "default_taps": {"eagle_config": {}}, "no_files": {},
        }[case]
        write_eagle3(directory, dirs["llama"], 7, taps=[1, 2, 3], **overrides)  # type: ignore[arg-type]
        if case == "no_files":
            (directory / "model.safetensors").unlink()
    reason = reason.format(dir=directory)
    with pytest.raises(ConfigError) as raised:
        LLM(str(dirs["llama"]), **BASE, **eagle3(directory))
    assert f"speculative.method 'eagle3': {reason}" in str(raised.value)
    config = tmp_path / "jackfield.toml"
    config.write_text(f'[model]\npath = "{dirs["llama"]}"\n[attention]\nbackend = "torch_ref"\n'
                      '[engine]\ndevice = "cpu"\n[speculative]\nmethod = "eagle3"\n'
                      f'num_speculative_tokens = 2\nmodel = "{directory}"\n')
    assert main(["doctor", "--config", str(config)]) == 2
    assert reason in capsys.readouterr().out


def test_no_draft_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"speculative.model: eagle3 drafts with a draft checkpoint"):
        LLM(**BASE, **{"speculative.method": "eagle3", "speculative.num_speculative_tokens": 2})


@pytest.mark.parametrize(("d2t", "reason"), [
    ("out_of_range", "draft id 39 maps to 97, outside the target model's vocabulary of 97"),
    ("missing", "d2t is missing"),
])
def test_a_bad_d2t_is_refused_naming_the_file(dirs: dict[str, Path], tmp_path: Path, d2t: str,
                                              reason: str) -> None:
    directory = tmp_path / "head"
    tensors = write_eagle3(directory, dirs["llama"], 7, taps=[1, 2, 3], draft_vocab=40)
    if d2t == "missing":
        del tensors["d2t"]
    else:
        tensors["d2t"][-1] = 97 - 39
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ConfigError) as raised:
        LLM(str(dirs["llama"]), **BASE, **eagle3(directory))
    assert f"{directory / 'model.safetensors'}: d2t" in str(raised.value) or d2t == "missing"
    assert reason in str(raised.value) and str(directory) in str(raised.value)


def test_a_tensor_of_the_wrong_shape_names_the_checkpoint(dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = tmp_path / "head"
    write_eagle3(directory, dirs["llama"], 7, taps=[1, 2, 3])
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"fc\.weight: checkpoint \(32, 64\), model \(32, 96\)") as raised:
        LLM(str(dirs["llama"]), **BASE, **eagle3(directory))
    assert str(directory) in str(raised.value)


def test_a_drafter_backend_kv_connector_or_fp8_cache_beside_eagle3_is_refused(dirs: dict[str, Path]) -> None:
    settings = {**BASE, **eagle3(dirs["head"])}
    with pytest.raises(ConfigError, match=r"drafter_backend 'torch_ref': .*target's attention backends"):
        LLM(str(dirs["llama"]), **settings, **{"attention.drafter_backend": "torch_ref"})
    with pytest.raises(ConfigError, match=r"'cpu_offload' with speculative.method 'eagle3' is not run yet"):
        LLM(str(dirs["llama"]), **settings, **{"kv_connector.name": "cpu_offload"})
    with pytest.raises(ConfigError, match=r"'fp8_e4m3' with speculative.method 'eagle3' is not run yet"):
        LLM(str(dirs["llama"]), **settings, **{"attention.kv_cache_dtype": "fp8_e4m3"})
