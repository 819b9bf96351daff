"""What a model needs from its attention backend, read from its Hugging Face config.json alone
(no weights), so `jackfield doctor` and the engine agree before anything loads."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from jackfield.config import JackfieldConfig
from jackfield.contracts.attention import AttentionRequirements
from jackfield.model_files import read_config_json

__all__ = ["attention_requirements", "read_config_json", "resolve_device", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: JackfieldConfig) -> str:
    device = config.engine.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"engine.device is {device!r} but no CUDA device is available")
    return device


def resolve_dtype(config: JackfieldConfig, device: str) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _DTYPES[config.model.dtype]


def attention_requirements(hf_config: Mapping[str, object], config: JackfieldConfig) -> AttentionRequirements:
    """MLA for DeepSeek-style configs (kv_lora_rank set), MHA/GQA otherwise. A config.json the
    built-in family would refuse at load raises its ValueError here (doctor and run report it)."""
    from jackfield.models.hf_config import check_builtin_family  # imports transformers: only when needed

    check_builtin_family(hf_config)
    device = resolve_device(config)
    num_spec = config.speculative.num_speculative_tokens
    common = dict(
        dtype=resolve_dtype(config, device),
        block_size=config.engine.block_size,
        device=device.split(":")[0],
        kv_cache_dtype=config.attention.kv_cache_dtype,
        dcp=config.parallel.dcp_size > 1,
        max_decode_query_len=1 + num_spec,
    )
    kv_lora_rank = hf_config.get("kv_lora_rank")
    non_causal = hf_config.get("is_causal") is False
    rope_dim = int(hf_config.get("qk_rope_head_dim", 64))  # type: ignore[arg-type]
    if kv_lora_rank and not non_causal:
        return AttentionRequirements(
            kind="mla",
            head_size=int(kv_lora_rank) + rope_dim,  # type: ignore[arg-type]
            sparse_topk=bool(hf_config.get("index_topk")),
            **common,  # type: ignore[arg-type]
        )
    if kv_lora_rank:  # bidirectional DeepSeek: the expanded form, per-head k_nope ‖ k_pe, on an MHA backend
        head_size = int(hf_config.get("qk_nope_head_dim", 128)) + rope_dim  # type: ignore[arg-type]
        return AttentionRequirements(kind="mha", head_size=head_size, non_causal=True, **common)  # type: ignore[arg-type]
    from jackfield.models.hf_config import layer_attention

    pattern = layer_attention(hf_config)
    heads = int(hf_config["num_attention_heads"])  # type: ignore[arg-type]
    head_dim = hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads  # type: ignore[arg-type]
    return AttentionRequirements(
        kind="mha",
        head_size=int(head_dim),  # type: ignore[arg-type]
        sliding_window=pattern.sliding_window,
        sinks=pattern.sinks or bool(hf_config.get("attention_sinks") or hf_config.get("use_sinks")),
        non_causal=non_causal,
        **common,  # type: ignore[arg-type]
    )
