"""DeepSeek bidirectional embeddings: `"is_causal": false` serves the registered DeepSeek class in
the expanded (non-MLA) form on an MHA backend; pooled vectors match transformers' DeepSeek model
of the same weights run with a full (non-causal) attention mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jackfield.attention.kv_cache import is_mla
from jackfield.models import model_class
from jackfield.models.embedding import pool, pooling_of
from jackfield.models.hf_config import read_hf_config
from jackfield.testing.checkpoints import DEEPSEEK, pooled_reference, write_deepseek
from jackfield.testing.paged import TORCH_REF, PagedRun

PROMPTS = [[5, 17, 3, 88, 42, 9, 61, 2, 33], [90, 1, 56, 23, 8]]


def write(tmp_path: Path, variant: str, pooling: str) -> tuple[torch.nn.Module, Path]:
    """A bidirectional DeepSeek embedder of `variant` ("v3" or "v2-no-qlora") pooling by `pooling`."""
    path = tmp_path / f"{variant}_{pooling}"
    return write_deepseek(variant, path, is_causal=False, pooling=pooling), path


@pytest.mark.parametrize(("variant", "pooling"), [("v3", "mean"), ("v3", "cls"), ("v2-no-qlora", "last")])
def test_pooled_embeddings_match_transformers_full_mask(variant: str, pooling: str, tmp_path: Path) -> None:
    hf_model, path = write(tmp_path, variant, pooling)
    config = read_hf_config(path)
    ours = model_class(config.architectures[0]).from_pretrained(path, config, TORCH_REF, torch.float32, "cpu")
    assert not ours.capabilities.causal and not any(is_mla(layer) for layer in ours.kv_cache_layers)
    run = PagedRun(ours, block_size=4, num_blocks=8, causal=False)
    reqs = [run.add() for _ in PROMPTS]
    hidden = run.step(list(zip(reqs, PROMPTS, strict=True)))
    got = pool(hidden, [0, len(PROMPTS[0]), len(PROMPTS[0]) + len(PROMPTS[1])], pooling_of(config.to_dict()))
    torch.testing.assert_close(got, pooled_reference(hf_model, pooling, PROMPTS), atol=1e-4, rtol=1e-4)


def test_llm_embed_matches_transformers(tmp_path: Path) -> None:
    from jackfield import LLM

    hf_model, path = write(tmp_path, "v3", "mean")
    llm = LLM(
        path, backend="torch_ref", block_size=4, max_num_batched_tokens=10
    )  # two steps for the two prompts
    got = llm.embed(PROMPTS)
    assert got.shape == (2, DEEPSEEK["hidden_size"]) and got.dtype == torch.float32
    torch.testing.assert_close(got, pooled_reference(hf_model, "mean", PROMPTS), atol=1e-4, rtol=1e-4)
    assert llm.engine.block_manager.num_free == llm.engine.runner.kv.num_blocks  # every block handed back


def test_causal_masking_would_change_the_answer(tmp_path: Path) -> None:
    """The parity above could not pass with causal attention: mean pooling differs."""
    hf_model, _ = write(tmp_path, "v3", "mean")
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        causal = torch.full((len(PROMPTS[0]),) * 2, float("-inf")).triu(1)[None, None]
        hidden = hf_model.model(ids, attention_mask=causal).last_hidden_state[0]
    assert (
        pool(hidden, [0, len(PROMPTS[0])], "mean") - pooled_reference(hf_model, "mean", PROMPTS)[:1]
    ).abs().max() > 1e-3


def test_pool_checks_its_inputs() -> None:
    hidden = torch.randn(5, 3)
    torch.testing.assert_close(
        pool(hidden, [0, 2, 5], "mean"), torch.stack([hidden[:2].mean(0), hidden[2:].mean(0)])
    )
    torch.testing.assert_close(pool(hidden, [0, 2, 5], "last"), hidden[[1, 4]])
    torch.testing.assert_close(pool(hidden, [0, 2, 5], "cls"), hidden[[0, 2]])
    with pytest.raises(ValueError, match="non-empty prompts"):
        pool(hidden, [0, 2, 2, 5], "mean")
    with pytest.raises(ValueError, match="not one of"):
        pool(hidden, [0, 5], "max")


def test_bad_pooling_in_config_fails_closed(tmp_path: Path) -> None:
    _, path = write(tmp_path, "v2-no-qlora", "mean")
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "pooling": "max"}))
    with pytest.raises(ValueError, match="pooling 'max' is not one of"):
        pooling_of(read_hf_config(path).to_dict())


def test_llm_embed_refuses_a_prompt_over_the_step_budget(tmp_path: Path) -> None:
    from jackfield import LLM

    _, path = write(tmp_path, "v2-no-qlora", "mean")
    llm = LLM(path, backend="torch_ref", block_size=4, max_num_batched_tokens=6)
    with pytest.raises(ValueError, match="exceeds engine.max_num_batched_tokens"):
        llm.embed(PROMPTS)  # 9 tokens: embedding cannot chunk a prompt
    assert llm.engine.block_manager.num_free == llm.engine.runner.kv.num_blocks
