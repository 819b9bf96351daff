"""What each family asks of its attention backend, read from config.json alone, and selection
rejecting a backend that lacks a needed feature with that reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from jackfield.builtins import TORCH_REF_CAPABILITIES
from jackfield.cli import main
from jackfield.config import JackfieldConfig
from jackfield.contracts.attention import AttentionRequirements
from jackfield.models.default_model import save_byte_tokenizer
from jackfield.plugins import Registered, load_registry
from jackfield.requirements import attention_requirements
from jackfield.selection import SelectionError, select_attention_backend
from jackfield.specs import AttentionBackendSpec
from jackfield.testing.checkpoints import DEEPSEEK, LLAMA, pooled_reference, write_deepseek
from transformers import DeepseekV3Config, DeepseekV32Config, GraniteConfig, GraniteSWAConfig, LlamaConfig


def requirements(config: object) -> AttentionRequirements:
    return attention_requirements(json.loads(config.to_json_string()), JackfieldConfig())  # type: ignore[attr-defined]


def plain_mha_registry():  # type: ignore[no-untyped-def]
    """torch_ref's kernels behind a record without sliding window, sinks or non-causal."""
    caps = dataclasses.replace(
        TORCH_REF_CAPABILITIES, kinds=("mha",), sliding_window=False, sinks=False, non_causal=False
    )
    registry = load_registry(entry_points=[])
    for name, capabilities in (("plain_mha", caps), ("torch_ref", TORCH_REF_CAPABILITIES)):
        spec = AttentionBackendSpec(
            name=name, factory="jackfield.attention.torch_ref:TorchRefBackend", capabilities=capabilities
        )
        registry.entries["attention"][name] = Registered("attention", spec, "test", "test-dist")
    return registry


def test_llama_and_granite_need_nothing_special() -> None:
    for config in (LlamaConfig(**LLAMA), GraniteConfig(**LLAMA)):
        req = requirements(config)
        assert (req.kind, req.head_size, req.sliding_window, req.sinks, req.non_causal) == (
            "mha",
            8,
            False,
            False,
            False,
        )
        assert select_attention_backend(req, "plain_mha", registry=plain_mha_registry()).name == "plain_mha"


def test_granite_swa_backend_without_windows_or_sinks_is_rejected_with_both_reasons() -> None:
    req = requirements(GraniteSWAConfig(**LLAMA, sliding_window=3))
    assert req.sliding_window and req.sinks
    with pytest.raises(SelectionError) as err:
        select_attention_backend(req, "plain_mha", registry=plain_mha_registry())
    assert "sliding_window not supported" in str(err.value) and "sinks not supported" in str(err.value)
    assert "would work: torch_ref" in str(err.value)
    # every layer full: no window needed, sinks still are (they are part of the architecture)
    full = requirements(GraniteSWAConfig(**LLAMA, layer_types=["full_attention"] * 4))
    assert not full.sliding_window and full.sinks


def test_bidirectional_deepseek_needs_non_causal_mha() -> None:
    config = DeepseekV3Config(**DEEPSEEK, is_causal=False, q_lora_rank=24, n_group=2, topk_group=1)
    req = requirements(config)
    qk_head_size = DEEPSEEK["qk_nope_head_dim"] + DEEPSEEK["qk_rope_head_dim"]
    assert (req.kind, req.head_size, req.non_causal) == ("mha", qk_head_size, True)
    with pytest.raises(SelectionError, match="non_causal not supported"):
        select_attention_backend(req, "plain_mha", registry=plain_mha_registry())
    assert select_attention_backend(req, "torch_ref", registry=plain_mha_registry()).name == "torch_ref"
    causal = requirements(DeepseekV3Config(**DEEPSEEK, is_causal=True, q_lora_rank=24))
    assert (causal.kind, causal.non_causal) == ("mla", False)


def test_v32_needs_sparse_topk() -> None:
    req = requirements(DeepseekV32Config(index_topk=64, num_hidden_layers=2))
    assert req.kind == "mla" and req.sparse_topk


def test_jackfield_run_task_embed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    path = tmp_path / "embedder"
    hf_model = write_deepseek("v3", path, vocab_size=300, is_causal=False, pooling="mean")
    save_byte_tokenizer(path)
    argv = ["run", "--model", str(path), "--task", "embed", "--attention-backend", "torch_ref", "--json"]
    assert main([*argv, "--prompt", "jackfield", "--prompt", "embeddings"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pooling"] == "mean" and out["dim"] == DEEPSEEK["hidden_size"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in ("jackfield", "embeddings")]
    want = pooled_reference(hf_model, "mean", ids)
    torch.testing.assert_close(torch.tensor(out["embeddings"]), want, atol=1e-4, rtol=1e-4)


def test_generate_on_a_bidirectional_model_is_refused(tmp_path: Path) -> None:
    from jackfield import LLM

    path = tmp_path / "embedder"
    write_deepseek("v2-no-qlora", path, is_causal=False, pooling="mean")
    with pytest.raises(ValueError, match="use LLM.embed"):
        LLM(path, backend="torch_ref").generate([[1, 2, 3]])
