"""GGUF checkpoints: a tiny Llama written with the `gguf` package (llama.cpp's tensor names and
metadata) runs through the engine with the greedy tokens and float32 logits of transformers
loading the same file; the conversion is cached, and bad files are named errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.config import ConfigError
from jackfield.gguf_files import checkpoint_dir
from jackfield.model_files import ModelFileError
from jackfield.testing.checkpoints import greedy_reference

V, H, LAYERS, FFN, HEADS, KV_HEADS = 97, 32, 2, 40, 4, 2


def write_tiny_llama_gguf(path: Path, seed: int) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(H)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(H // HEADS)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(V)

    def tensor(name: str, *shape: int, center: float = 0.0) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.3 + center).astype(np.float32))

    tensor("token_embd.weight", V, H)
    tensor("output_norm.weight", H, center=1.0)
    tensor("output.weight", V, H)
    head = H // HEADS
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", H, center=1.0)
        tensor(f"blk.{i}.ffn_norm.weight", H, center=1.0)
        tensor(f"blk.{i}.attn_q.weight", HEADS * head, H)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head, H)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head, H)
        tensor(f"blk.{i}.attn_output.weight", H, HEADS * head)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, H)
        tensor(f"blk.{i}.ffn_up.weight", FFN, H)
        tensor(f"blk.{i}.ffn_down.weight", H, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JACKFIELD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_generates_like_transformers_reading_it(
    tmp_path: Path, cache: Path, rng_seed: int
) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "gguf"
    folder.mkdir()
    write_tiny_llama_gguf(folder / "tiny.gguf", rng_seed % 2**32)
    reference = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    prompts = [
        torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(rng_seed + n)).tolist()
        for n in (5, 13)
    ]
    for model in (folder / "tiny.gguf", folder):  # the file, or a folder holding one
        llm = LLM(str(model), device="cpu", backend="torch_ref", dtype="float32")
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
        )
        for prompt, out in zip(prompts, outs, strict=True):
            want, logits = greedy_reference(reference, prompt, 6)
            assert out.token_ids == want
            last = torch.log_softmax(logits[-1].double(), dim=-1)
            for token, logprob in out.logprobs[-1].items():
                assert abs(logprob - last[token].item()) < 1e-4
    converted = checkpoint_dir(folder / "tiny.gguf")
    assert converted.parent == cache / "gguf"
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    LLM(str(folder / "tiny.gguf"), device="cpu")  # cached: not converted again
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_bad_gguf_inputs_are_named(tmp_path: Path, cache: Path, rng_seed: int) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really" * 10)
    with pytest.raises(ConfigError, match="broken.gguf: transformers cannot read this GGUF file"):
        LLM(str(broken), device="cpu")  # doctor and run report it alike (preflight)
    with pytest.raises(ModelFileError, match="broken.gguf"):
        checkpoint_dir(broken)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_tiny_llama_gguf(two / name, rng_seed % 2**32)
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        LLM(str(two), device="cpu")
