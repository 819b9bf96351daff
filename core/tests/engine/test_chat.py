"""LLM.chat: conversations rendered by the model folder's chat template (checked against the
template's text written out by hand), then generated as any prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jackfield import LLM, SamplingParams

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_chat_renders_the_template_and_generates(model: Path) -> None:
    plain = LLM(str(model), device="cpu")
    with pytest.raises(ValueError, match="has no chat template .tokenizer_config.json chat_template."):
        plain.chat([{"role": "user", "content": "hi"}], GREEDY)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    llm = LLM(str(model), device="cpu")
    conversations = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
    ]
    outs = llm.chat(conversations, GREEDY)
    for conversation, out in zip(conversations, outs, strict=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
        want_ids = llm.tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)
        assert out.prompt_token_ids == want_ids
        assert out.token_ids == llm.generate([want_ids], GREEDY)[0].token_ids
    assert [o.token_ids for o in llm.chat(conversations[0], GREEDY)] == [
        outs[0].token_ids
    ]  # one conversation
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        llm.chat([{"content": "no role"}], GREEDY)


def test_a_stop_string_ends_the_output_before_it(model: Path, rng_seed: int) -> None:
    """A stop string taken from the middle of the greedy text (it spans several byte tokens):
    the output stops at the token that completes it, the text ends before it, reason "stop"."""
    llm = LLM(str(model), device="cpu")
    prompt = "The quick brown fox"
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert full.text is not None and len(full.text) > 12
    # three characters with no replacement mark (a byte that only a later token completes)
    starts = [i for i in range(2, len(full.text) - 3) if "\ufffd" not in full.text[i : i + 3]]
    assert starts, f"no clean stop string in {full.text!r}"
    start = starts[rng_seed % len(starts)]
    stop = full.text[start : start + 3]
    got = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "never appears \u2603"]),
    )[0]
    assert got.finish_reason == "stop"
    assert got.text == full.text[: full.text.index(stop)]
    assert got.token_ids == full.token_ids[: len(got.token_ids)]  # a prefix: the run stopped early
    assert stop in llm.tokenizer.decode(got.token_ids) and stop not in llm.tokenizer.decode(
        got.token_ids[:-1]
    )
    with pytest.raises(ValueError, match="stop must be a non-empty string"):
        SamplingParams(stop=[""])
