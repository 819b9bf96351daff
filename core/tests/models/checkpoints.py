"""Small random DeepSeek checkpoints written by transformers (the reference implementation)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

VARIANTS: dict[str, tuple[type, type, dict[str, object]]] = {
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(q_lora_rank=48, n_group=2, topk_group=1)),
    "v3-no-qlora-yarn": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=None, n_group=4, topk_group=2, rope_interleave=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                             mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
    )),
    "v2-grouped": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=48, topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5)),
    "v2-no-qlora": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(q_lora_rank=None, topk_method="greedy")),
}


def write_checkpoint(variant: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Save a random model of `variant` into `directory`; return the transformers model (float32, eval)."""
    config_cls, model_cls, extra = VARIANTS[variant]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # exercise the router bias (transformers starts it at zero)
        for layer in model.model.layers[config.first_k_dense_replace :]:
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.uniform_(-0.1, 0.1)
    model.save_pretrained(str(directory))
    return model
