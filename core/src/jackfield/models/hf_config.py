"""Hugging Face config -> the facts Jackfield builds a model from. The one place that reads HF fields.

The model is built from the real transformers config object (AutoConfig on a local directory);
this module pulls out what the engine and the layers need, fails closed on what is unsupported,
and computes the RoPE frequencies and the attention softmax scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

# RoPE types whose frequencies do not depend on the sequence length (those we can precompute).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def read_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """AutoConfig on a local directory only: Jackfield never downloads."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a local Hugging Face model directory)")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def architecture_of(hf_config: PretrainedConfig) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {archs}")
    return archs[0]


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, object]:
    """The RoPE settings (transformers 5 `rope_parameters`, or the older `rope_scaling` + `rope_theta`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(hf_config: PretrainedConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, cos/sin scaling) for the config's RoPE type."""
    params = rope_parameters(hf_config)
    rope_type = str(params["rope_type"])
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})")
    if rope_type == "default":
        base = float(params["rope_theta"])  # type: ignore[arg-type]
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        return (1.0 / base**exponent).float(), 1.0
    # The scaled types: transformers' own frequency formulas (YaRN ramps, llama3 bands).
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if inv_freq.numel() != rotary_dim // 2:
        raise ValueError(f"RoPE produced {inv_freq.numel()} frequencies for rotary dim {rotary_dim}")
    return inv_freq.float(), float(attention_scaling)


def yarn_softmax_scale(hf_config: PretrainedConfig, head_dim: int) -> float:
    """DeepSeek's softmax scale: head_dim**-0.5, times mscale**2 when YaRN sets mscale_all_dim."""
    scale = head_dim**-0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = float(params.get("mscale_all_dim", 0) or 0)  # type: ignore[arg-type]
    factor = float(params.get("factor", 1.0) or 1.0)  # type: ignore[arg-type]
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class DeepseekArch:
    """A DeepSeek-V2/V3 config, translated. `moe_scoring` is V2's softmax or V3's sigmoid."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    first_k_dense_replace: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    moe_scoring: str  # softmax | sigmoid
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope_interleave: bool
    softmax_scale: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_mtp_layers: int  # next-token-prediction layers stored after the main ones (not run)

    def is_moe_layer(self, index: int) -> bool:
        return self.n_routed_experts is not None and index >= self.first_k_dense_replace


def deepseek_arch(hf_config: PretrainedConfig) -> DeepseekArch:
    arch = architecture_of(hf_config)
    v3 = arch == "DeepseekV3ForCausalLM"
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        raise ValueError(f"{arch} is not a DeepSeek-V2/V3 architecture")
    c = hf_config
    problems = []
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (only 'silu')")
    if getattr(c, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(c, "mlp_bias", False):
        problems.append("mlp_bias=True")
    if getattr(c, "quantization_config", None):
        problems.append("quantized checkpoints (quantization_config)")
    topk_method = "noaux_tc" if v3 else str(getattr(c, "topk_method", "greedy"))
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        problems.append(f"topk_method {topk_method!r}")
    if problems:
        raise ValueError(f"{arch}: unsupported settings: " + "; ".join(problems))
    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    n_group = int(getattr(c, "n_group", None) or 1)
    return DeepseekArch(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rms_norm_eps=float(c.rms_norm_eps),
        first_k_dense_replace=int(getattr(c, "first_k_dense_replace", 0) or 0),
        n_routed_experts=getattr(c, "n_routed_experts", None),
        n_shared_experts=int(getattr(c, "n_shared_experts", 0) or 0),
        num_experts_per_tok=int(getattr(c, "num_experts_per_tok", 0) or 0),
        n_group=n_group,
        topk_group=int(getattr(c, "topk_group", None) or n_group),
        topk_method=topk_method,
        moe_scoring="sigmoid" if v3 else "softmax",
        # transformers' V2 never renormalizes the top-k weights; V3 follows the flag.
        norm_topk_prob=bool(getattr(c, "norm_topk_prob", False)) and v3,
        routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0)),
        rope_interleave=bool(getattr(c, "rope_interleave", True)) if v3 else True,
        softmax_scale=yarn_softmax_scale(c, qk_head_dim),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        max_position_embeddings=int(c.max_position_embeddings),
        num_mtp_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0),
    )
