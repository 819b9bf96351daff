"""The head train_eagle3 trains is the function the `eagle3` drafter computes: a random
`Eagle3TrainingHead`, written with `save_head`, drafts inside the engine (every step of a sampled
request: the prefill, then verify steps with drafts accepted and rejected); at each step the
engine's draft distributions must equal the training head unrolled over the same tokens
(teacher-forced on the request's tokens followed by its drafts), with the taps taken from
transformers' forward (`hidden_states[i]`, the input of layer i) as training takes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.contracts.model import eagle3_tap_layers
from jackfield.testing.checkpoints import write_granite
from jackfield_spec_decode.eagle3_training import Eagle3TrainingHead, init_from_target, save_head
from transformers import AutoModelForCausalLM

K = 3
DRAFT_VOCAB = 60
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32"}
# SmolLM2's shape in small: tied embeddings, a RoPE base that is not the default, head_dim given
TARGET = dict(num_hidden_layers=8, tie_word_embeddings=True, max_position_embeddings=128, head_dim=8,
              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def random_head(cfg: dict, seed: int) -> Eagle3TrainingHead:
    """A head with random weights (norms too), already bf16-exact, so that the checkpoint
    `save_head` writes in bf16 holds exactly the head's function."""
    torch.manual_seed(seed)
    head = Eagle3TrainingHead(cfg, DRAFT_VOCAB)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name == "lm_head.weight":
                # drafts neither uniform nor one-hot (the likeliest draft ~12x uniform), and each
                # accepted with probability ~0.3 against the random target: an acceptance in a
                # request's ~25 verify steps is then certain whatever the seed (at 8x: ~0.05)
                p.mul_(3)
            p.copy_(p.bfloat16().float())
    return head.eval()


@pytest.mark.parametrize("target_format", ["rope_parameters", "rope_theta"])
def test_the_training_head_drafts_what_the_engine_drafts(tmp_path: Path, target_format: str,
                                                        rng_seed: int) -> None:
    print(f"seed {rng_seed}")
    target_dir = tmp_path / "target"
    write_granite("llama_tied", target_dir, rng_seed, **TARGET)
    cfg_path = target_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if target_format == "rope_theta":  # transformers 4 writes the RoPE base at the top level
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg_path.write_text(json.dumps(cfg))
    vocab, taps = cfg["vocab_size"], eagle3_tap_layers(cfg["num_hidden_layers"])
    head = random_head(cfg, rng_seed)
    g = torch.Generator().manual_seed(rng_seed)
    draft_ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    save_head(head, cfg, draft_ids, vocab, taps, tmp_path / "head")

    target = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    embedding = target.get_input_embeddings().weight
    eagle3 = {"speculative.method": "eagle3", "speculative.num_speculative_tokens": K,
              "speculative.model": str(tmp_path / "head")}
    llm = LLM(str(target_dir), **BASE, **eagle3)
    prompt = torch.randint(0, vocab, (13,), generator=g).tolist()
    seq = llm.engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=40, seed=rng_seed % 1000,
                                                        ignore_eos=True))
    checked = accepted = 0
    while seq.finish_time is None:
        before = seq.num_tokens
        llm.engine.step()
        accepted += max(0, seq.num_tokens - before - 1)
        if seq.finish_time is not None or not seq.draft_ids:
            continue
        tokens, drafts, probs = list(seq.token_ids), list(seq.draft_ids), seq.draft_probs
        assert probs is not None and len(probs) == len(drafts)
        ids = torch.tensor([tokens + drafts[:-1]])  # step s at anchor N - 2 reads the token at N - 1 + s
        with torch.no_grad():
            states = target(ids, output_hidden_states=True).hidden_states
            tapped = torch.cat([states[i] for i in taps], -1)
            outs = head.unroll(tapped, embedding[ids], len(drafts))
        for s, out in enumerate(outs):
            draft = head.logits(out[0, len(tokens) - 2]).softmax(-1).detach()
            want = torch.zeros(vocab).index_copy_(0, draft_ids, draft)
            where = f"draft {s} at {len(tokens)} tokens"
            torch.testing.assert_close(probs[s].float(), want, atol=2e-5, rtol=1e-4,
                                       msg=lambda m, where=where: f"{where}: {m}")
        checked += 1
    assert checked >= 8 and accepted > 0, (checked, accepted)  # verify steps, and some accepted drafts


def test_a_head_initialised_from_the_target_is_its_last_layer(tmp_path: Path, rng_seed: int) -> None:
    """`init_from_target`: fed the input of the target's last layer as its deepest tap (the other
    taps and the drafted token's embedding random, which the start must ignore), the head's
    step 0 read out through its norm and lm_head gives transformers' logits of the target at the
    draft vocabulary's ids (a row copied for the wrong target id, a weight copied into the
    embedding's half of the attention input or the wrong tap passed through fails it)."""
    print(f"seed {rng_seed}")
    write_granite("llama_tied", tmp_path, rng_seed, **TARGET)
    cfg = json.loads((tmp_path / "config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    g = torch.Generator().manual_seed(rng_seed)
    draft_ids = torch.randperm(cfg["vocab_size"], generator=g)[:DRAFT_VOCAB].sort().values
    head = random_head(cfg, rng_seed)
    init_from_target(head, target, draft_ids)
    ids = torch.randint(0, cfg["vocab_size"], (2, 19), generator=g)
    h = cfg["hidden_size"]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        last_input = out.hidden_states[cfg["num_hidden_layers"] - 1]
        tapped = torch.cat((torch.randn(2, 19, 2 * h, generator=g), last_input), -1)
        step0 = head.unroll(tapped, torch.randn(2, 19, h, generator=g), 1)[0]
        torch.testing.assert_close(head.logits(step0), out.logits[..., draft_ids], atol=1e-4, rtol=1e-4)
