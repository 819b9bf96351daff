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
