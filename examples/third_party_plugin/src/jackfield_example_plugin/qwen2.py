"""Qwen2 (`Qwen2ForCausalLM`) as a third-party model family, written against the contract in
`jackfield.contracts.model` and core's building blocks: GQA attention whose q/k/v projections
carry a bias, RoPE, a SwiGLU MLP and RMSNorm.

Checkpoints with `use_sliding_window = true` are refused: this family runs full attention only.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.model import ModelCapabilities, ModelFamily
from jackfield.models.attention import RoleImpls
from jackfield.models.hf_config import rope_inv_freq
from jackfield.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, select_rows
from jackfield.models.weights import Rule, WeightMapper, iter_checkpoint, load_weights
from torch import nn
from transformers import PretrainedConfig

_LAYER = r"(?P<layer>model\.layers\.\d+)"
QWEN2_WEIGHTS = WeightMapper(
    rules=(
        Rule(_LAYER + r"\.mlp\.gate_proj\.weight", "{layer}.mlp.gate_up_proj.weight", shard=(0, 2)),
        Rule(_LAYER + r"\.mlp\.up_proj\.weight", "{layer}.mlp.gate_up_proj.weight", shard=(1, 2)),
        Rule(r"(?P<name>.+)", "{name}"),
    ),
)


class BiasedLinear(Linear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Qwen2Layer(nn.Module):
    def __init__(self, c: PretrainedConfig, index: int, spec: AttentionLayerSpec, backends: AttentionBackends,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.index, self.spec = index, spec
        d, h, kv, hd = c.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = BiasedLinear(d, h * hd, dtype)
        self.self_attn.k_proj = BiasedLinear(d, kv * hd, dtype)
        self.self_attn.v_proj = BiasedLinear(d, kv * hd, dtype)
        self.self_attn.o_proj = Linear(h * hd, d, dtype)
        self.attn = RoleImpls(backends, spec)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(d, c.intermediate_size, dtype)


class Qwen2ForCausalLM(ModelFamily):
    def __init__(self, hf_config: PretrainedConfig, backends: AttentionBackends, dtype: torch.dtype,
                 kv_cache_dtype: KVCacheDType = "auto") -> None:
        super().__init__()
        c = hf_config
        if getattr(c, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window = true is not supported by this example family")
        self.hf_config, self.dtype = c, dtype
        head_dim = c.hidden_size // c.num_attention_heads
        self.spec = AttentionLayerSpec(num_heads=c.num_attention_heads, head_size=head_dim,
                                       scale=head_dim**-0.5, num_kv_heads=c.num_key_value_heads,
                                       kv_cache_dtype=kv_cache_dtype)
        inv_freq, scaling = rope_inv_freq(c, head_dim)
        self.rope = RotaryEmbedding(inv_freq, scaling, c.max_position_embeddings, interleaved=False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, dtype=dtype), False)
        self.model.layers = nn.ModuleList(
            Qwen2Layer(c, i, self.spec, backends, dtype) for i in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: PretrainedConfig, backends: AttentionBackends,
                        dtype: torch.dtype, device: torch.device | str,
                        kv_cache_dtype: KVCacheDType = "auto") -> Qwen2ForCausalLM:
        with torch.device(device):
            model = cls(hf_config, backends, dtype, kv_cache_dtype)
        ignore = (r"lm_head\.weight",) if hf_config.tie_word_embeddings else ()
        load_weights(dict(model.named_parameters()), iter_checkpoint(model_dir),
                     WeightMapper(QWEN2_WEIGHTS.rules, ignore))
        return model.eval()

    @functools.cached_property
    def capabilities(self) -> ModelCapabilities:
        c = self.hf_config
        return ModelCapabilities(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                 num_layers=c.num_hidden_layers, max_model_len=c.max_position_embeddings,
                                 dtype=self.dtype, cuda_graph_safe=True)

    @property
    def kv_cache_layers(self) -> list[AttentionLayerSpec]:
        return [self.spec] * self.hf_config.num_hidden_layers

    @property
    def attention_output_shape(self) -> tuple[int, int]:
        return self.spec.num_heads, self.spec.head_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def before_attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer, s, t = self.model.layers[i], self.spec, x.shape[0]
        x = layer.input_layernorm(x)
        q = layer.self_attn.q_proj(x).view(t, s.num_heads, s.head_size)
        k = layer.self_attn.k_proj(x).view(t, s.num_kv_heads, s.head_size)
        v = layer.self_attn.v_proj(x).view(t, s.num_kv_heads, s.head_size)
        return self.rope(q, positions), self.rope(k, positions), v

    def attend(self, i: int, step: StepContext, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model.layers[i].attn.run(step, i, *inputs)

    def after_attention(self, i: int, x: torch.Tensor, attn_out: torch.Tensor,
                        output_rows: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.model.layers[i]
        out = select_rows(attn_out, output_rows)
        x = select_rows(x, output_rows) + layer.self_attn.o_proj(out.reshape(out.shape[0], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.hf_config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
