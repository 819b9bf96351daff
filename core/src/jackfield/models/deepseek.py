"""DeepSeek-V2/V3: multi-head latent attention + mixture of experts, on the paged KV cache.

Parameter names follow the Hugging Face checkpoint except where weights are fused (gate ‖ up)
or stacked (experts); DEEPSEEK_WEIGHTS says how. kv_b_proj is loaded, handed to the attention
impl (which splits it into W_UK / W_UV), then dropped.

Multi-token prediction (the MTP drafter): the checkpoint stores `num_nextn_predict_layers` MTP
layers after the main ones (`model.layers.{L + i}`). They are skipped at load unless a drafter
runs them (`load_mtp_layers`); then each is, for a row at position p pairing the token t at p + 1
with the hidden state h of p (DeepSeek-V3 report, section 2.2; vLLM's deepseek_mtp):
    h' = eh_proj(cat(enorm(embed(t)), hnorm(h)))     (embedding first; zero where p == 0)
    x  = decoder_layer(h')                           (MLA over the MTP layer's own KV cache, MLP/MoE)
    logits = head(shared_head.norm(x))               (embedding and head: the target's)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.model import ModelCapabilities
from jackfield.distributed.cp_common import parallel_state
from jackfield.distributed.tensor_parallel import (
    all_reduce,
    embed,
    gather_logits,
    head_split,
    local_size,
    part,
)
from jackfield.models.attention import RoleImpls
from jackfield.models.hf_config import DeepseekArch, deepseek_arch, rope_inv_freq
from jackfield.models.layers import DecoderStack, GatedMLP, Linear, RMSNorm, RotaryEmbedding, select_rows
from jackfield.models.moe import DeepseekMoE, grouped_mm_supported
from jackfield.models.weights import (
    Rule,
    ShardPlan,
    Split,
    WeightMapper,
    iter_checkpoint,
    iter_checkpoint_slices,
    load_weights,
)

_MLP = r"(?P<mlp>model\.layers\.\d+\.mlp(?:\.shared_experts)?)"
_EXPERT = r"(?P<moe>model\.layers\.\d+\.mlp)\.experts\.(?P<e>\d+)"

DEEPSEEK_WEIGHTS = WeightMapper(
    rules=(
        Rule(_MLP + r"\.gate_proj\.weight", "{mlp}.gate_up_proj.weight", shard=(0, 2)),
        Rule(_MLP + r"\.up_proj\.weight", "{mlp}.gate_up_proj.weight", shard=(1, 2)),
        Rule(_EXPERT + r"\.gate_proj\.weight", "{moe}.experts.w13", shard=(0, 2), expert="e"),
        Rule(_EXPERT + r"\.up_proj\.weight", "{moe}.experts.w13", shard=(1, 2), expert="e"),
        Rule(_EXPERT + r"\.down_proj\.weight", "{moe}.experts.w2", expert="e"),
        Rule(r"(?P<name>.+)", "{name}"),
    ),
    ignore=(r".*\.rotary_emb\.inv_freq",),
)


def deepseek_weight_mapper(arch: DeepseekArch) -> WeightMapper:
    """DEEPSEEK_WEIGHTS, also skipping the multi-token-prediction layers (stored after the main
    ones; not run) and a tied lm_head."""
    ignore = list(DEEPSEEK_WEIGHTS.ignore)
    mtp = "|".join(str(arch.num_layers + i) for i in range(arch.num_mtp_layers))
    if mtp:
        ignore.append(rf"model\.layers\.(?:{mtp})\..*")
    if arch.tie_word_embeddings:
        ignore.append(r"lm_head\.weight")
    return WeightMapper(DEEPSEEK_WEIGHTS.rules, tuple(ignore))


def deepseek_shard_plan(arch: DeepseekArch) -> ShardPlan:
    """This rank's part of each parameter (docs/parallelism.md): query heads, MLP and shared
    expert columns and vocabulary rows split over every rank; kv_b_proj over the head groups
    (the heads a rank attends under DCP); routed experts whole, a run of them per rank; the
    latent projections (kv_a, q_a) and the router replicated."""
    tp = parallel_state()
    rank, size = tp.tp_rank, tp.tp_size
    column, row = Split(0, rank, size), Split(1, rank, size)
    layer = r"model\.layers\.\d+\."
    experts = local_size(int(arch.n_routed_experts or 0))
    return ShardPlan(splits=(
        (layer + r"self_attn\.(?:q_proj|q_b_proj)\.weight", column),
        (layer + r"self_attn\.kv_b_proj\.weight", Split(0, tp.head_group, tp.num_head_groups)),
        (layer + r"self_attn\.o_proj\.weight", row),
        (layer + r"mlp(?:\.shared_experts)?\.gate_up_proj\.weight", column),
        (layer + r"mlp(?:\.shared_experts)?\.down_proj\.weight", row),
        (r"model\.embed_tokens\.weight|lm_head\.weight", column),
    ), experts=(rank * experts, experts))


class MLAAttention(nn.Module):
    def __init__(self, arch: DeepseekArch, index: int, spec: AttentionLayerSpec, backends: AttentionBackends,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.arch, self.index = arch, index
        qk_head_dim = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        # This rank's query heads; kv_b_proj holds those its attention attends (spec.num_heads:
        # its DCP group's under decode context parallel, else its own).
        d, h = arch.hidden_size, head_split(arch.num_heads, 1).num_heads
        self.num_heads = h
        if arch.q_lora_rank is None:
            self.q_proj = Linear(d, h * qk_head_dim, dtype)
        else:
            self.q_a_proj = Linear(d, arch.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = Linear(arch.q_lora_rank, h * qk_head_dim, dtype)
        self.kv_a_proj_with_mqa = Linear(d, arch.kv_lora_rank + arch.qk_rope_head_dim, dtype)
        self.kv_a_layernorm = RMSNorm(arch.kv_lora_rank, 1e-6, dtype)
        kv_b_rows = spec.num_heads * (arch.qk_nope_head_dim + arch.v_head_dim)
        self.kv_b_proj: Linear | None = Linear(arch.kv_lora_rank, kv_b_rows, dtype)
        self.o_proj = Linear(h * arch.v_head_dim, d, dtype)  # row-parallel: the layer all-reduces
        self.attn = RoleImpls(backends, spec)

    def finish_loading(self) -> None:
        assert self.kv_b_proj is not None, "finish_loading runs once"
        self.attn.process_weights_after_loading({"kv_b_proj": self.kv_b_proj.weight.data})
        self.kv_b_proj = None

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, D] -> q [T, H, N+R] (roped), kv_c [T, L] (normed), k_pe [T, R] (roped), and the q
        latent [T, q_lora_rank] (None without q_lora)."""
        a, t = self.arch, x.shape[0]
        q_latent = None
        if a.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        h = self.num_heads
        q = q.view(t, h, a.qk_nope_head_dim + a.qk_rope_head_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        # The query heads' rope parts and the one rope key rotate in one call (fewer launches).
        pe = rope(torch.cat((q[..., a.qk_nope_head_dim :], k_pe.unsqueeze(1)), dim=1), positions)
        q = torch.cat((q[..., : a.qk_nope_head_dim], pe[:, :h]), dim=-1)
        return q, kv_c, pe[:, h], q_latent

    def attend(self, step: StepContext, q: torch.Tensor, kv_c: torch.Tensor,
               k_pe: torch.Tensor) -> torch.Tensor:
        """The attention backend's part: writes every row's KV, returns [T, H, V]."""
        return self.attn.run(step, self.index, q, kv_c, k_pe)

    def output(self, out: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj of the attention output's `output_rows` (all rows when None): this rank's part
        under tensor parallelism."""
        out = select_rows(out, output_rows)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.arch.v_head_dim))


class ExpandedMLAAttention(MLAAttention):
    """The expanded form on a standard (MHA) backend, for bidirectional embedding models: per-head
    k = kv_c W_UK^T ‖ k_pe and v = kv_c W_UV (zero-padded to k's width to share the MHA cache).
    kv_b_proj stays a weight of this layer."""

    def finish_loading(self) -> None:
        """Nothing to hand over: the MHA impl never sees kv_b_proj."""

    def attend(self, step: StepContext, q: torch.Tensor, kv_c: torch.Tensor,
               k_pe: torch.Tensor) -> torch.Tensor:
        a, t = self.arch, q.shape[0]
        assert self.kv_b_proj is not None
        k_nope, v = self.kv_b_proj(kv_c).view(t, a.num_heads, -1).split([a.qk_nope_head_dim, a.v_head_dim],
                                                                         dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(t, a.num_heads, a.qk_rope_head_dim)), dim=-1)
        v = F.pad(v, (0, k.shape[-1] - a.v_head_dim))
        return self.attn.run(step, self.index, q, k, v)[..., : a.v_head_dim]


def attention_spec(arch: DeepseekArch, kv_cache_dtype: KVCacheDType) -> AttentionLayerSpec:
    """The latent (MLA) layer spec, or for non-causal models the expanded MHA one."""
    if arch.non_causal:
        head_size = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        if arch.v_head_dim > head_size:
            raise ValueError(f"v_head_dim {arch.v_head_dim} exceeds the key width {head_size}: "
                             "no shared MHA cache")
        return AttentionLayerSpec(num_heads=arch.num_heads, head_size=head_size, scale=arch.softmax_scale,
                                  num_kv_heads=arch.num_heads, kv_cache_dtype=kv_cache_dtype)
    return AttentionLayerSpec(
        num_heads=head_split(arch.num_heads, 1).num_attend_heads,  # all of them in one process
        head_size=arch.kv_lora_rank + arch.qk_rope_head_dim,
        scale=arch.softmax_scale,
        kv_cache_dtype=kv_cache_dtype,
        kv_lora_rank=arch.kv_lora_rank,
        qk_nope_head_dim=arch.qk_nope_head_dim,
        qk_rope_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
    )


class DecoderLayer(nn.Module):
    def __init__(self, arch: DeepseekArch, index: int, self_attn: MLAAttention, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp: nn.Module = (
            DeepseekMoE(arch, dtype) if arch.is_moe_layer(index)
            else GatedMLP(arch.hidden_size, local_size(arch.intermediate_size), dtype)
        )

    def before_attention(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's inputs (q, kv_c, k_pe) from the layer's input x."""
        q, kv_c, k_pe, _ = self.self_attn.project(self.input_layernorm(x), positions, rope)
        return q, kv_c, k_pe

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor,
                        output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for `output_rows` of x (all rows when None), from its attention output."""
        x = select_rows(x, output_rows) + all_reduce(self.self_attn.output(attn_out, output_rows))
        return x + all_reduce(self.mlp(self.post_attention_layernorm(x)))


class MTPLayer(DecoderLayer):
    """A multi-token-prediction layer: a decoder layer (its index picks MLP or MoE as for any
    layer) after enorm, hnorm and eh_proj, and before shared_head.norm."""

    def __init__(self, arch: DeepseekArch, index: int, self_attn: MLAAttention, dtype: torch.dtype) -> None:
        super().__init__(arch, index, self_attn, dtype)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.enorm = RMSNorm(size, eps, dtype)
        self.hnorm = RMSNorm(size, eps, dtype)
        self.eh_proj = Linear(2 * size, size, dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(size, eps, dtype)


class DeepseekForCausalLM(DecoderStack):
    """Built from the transformers config; `from_pretrained` loads a local checkpoint directory."""

    def __init__(self, hf_config: PretrainedConfig, backends: AttentionBackends, dtype: torch.dtype,
                 kv_cache_dtype: KVCacheDType = "auto") -> None:
        super().__init__()
        arch = deepseek_arch(hf_config)
        self.arch, self.dtype, self.backends = arch, dtype, backends
        self.num_loaded_mtp_layers = 0  # `load_mtp_layers` appends them to model.layers
        self.attention_spec = attention_spec(arch, kv_cache_dtype)
        inv_freq, rope_scaling = rope_inv_freq(hf_config, arch.qk_rope_head_dim)
        self.rope = RotaryEmbedding(inv_freq, rope_scaling, arch.max_position_embeddings,
                                    arch.rope_interleave)
        tp = parallel_state()
        start, stop = part(arch.vocab_size, tp.tp_rank, tp.tp_size)  # this rank's vocabulary rows
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(
            torch.empty(stop - start, arch.hidden_size, dtype=dtype), False)
        self.model.layers = nn.ModuleList(
            DecoderLayer(arch, i, self.make_attention(i, backends), dtype) for i in range(arch.num_layers)
        )
        self.model.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(arch.hidden_size, stop - start, dtype)

    @functools.cached_property
    def capabilities(self) -> ModelCapabilities:
        a = self.arch
        return ModelCapabilities(
            vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.num_layers,
            max_model_len=a.max_position_embeddings, dtype=self.dtype, causal=not a.non_causal,
            cuda_graph_safe=self._cuda_graph_safe(), num_mtp_layers=a.num_mtp_layers,
            tensor_parallel=not a.non_causal,  # the expanded bidirectional form is not split yet
        )

    def _cuda_graph_safe(self) -> bool:
        """True where the experts run as grouped matmuls (the per-expert loop reads group sizes
        on the host)."""
        moe = any(isinstance(layer.mlp, DeepseekMoE) for layer in self.model.layers)
        return not moe or grouped_mm_supported(self.model.embed_tokens.weight.device, self.dtype)

    def make_attention(self, index: int, backends: AttentionBackends) -> MLAAttention:
        """Layer `index`'s attention (a family variant overrides this)."""
        attn_cls = ExpandedMLAAttention if self.arch.non_causal else MLAAttention
        return attn_cls(self.arch, index, self.attention_spec, backends, self.dtype)

    @property
    def kv_cache_layers(self) -> list[AttentionLayerSpec]:
        """One attention layer spec per KV cache the model writes (the engine allocates them):
        the decoder layers', then the loaded MTP layers'."""
        return [self.attention_spec] * (self.arch.num_layers + self.num_loaded_mtp_layers)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: PretrainedConfig, backends: AttentionBackends,
                        dtype: torch.dtype, device: torch.device | str,
                        kv_cache_dtype: KVCacheDType = "auto") -> DeepseekForCausalLM:
        with torch.device(device):
            model = cls(hf_config, backends, dtype, kv_cache_dtype)
        params, mapper = dict(model.named_parameters()), deepseek_weight_mapper(model.arch)
        if parallel_state().tp_size == 1:
            load_weights(params, iter_checkpoint(model_dir), mapper)
        else:
            load_weights(params, iter_checkpoint_slices(model_dir), mapper, deepseek_shard_plan(model.arch))
        for layer in model.model.layers:
            layer.self_attn.finish_loading()
        return model.eval()

    @property
    def attention_output_shape(self) -> tuple[int, int]:
        """One row of `attend`'s output: [heads (this rank's), v_head_dim]."""
        return head_split(self.arch.num_heads, 1).num_heads, self.arch.v_head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed(input_ids, self.model.embed_tokens.weight, self.arch.vocab_size)

    def before_attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model.layers[i].before_attention(x, positions, self.rope)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(F.linear(hidden, self.head_weight).float(), self.arch.vocab_size)

    def load_mtp_layers(self, model_dir: str | Path) -> None:
        a, first = self.arch, self.arch.num_layers
        if a.num_mtp_layers == 0 or a.non_causal:
            why = "a bidirectional model" if a.non_causal else "num_nextn_predict_layers is 0"
            raise ValueError(f"{model_dir}: no multi-token-prediction layers to run ({why})")
        if self.num_loaded_mtp_layers:
            raise ValueError("the multi-token-prediction layers are loaded already")
        with torch.device(self.model.embed_tokens.weight.device):
            layers = [MTPLayer(a, first + i, self.make_attention(first + i, self.backends), self.dtype)
                      for i in range(a.num_mtp_layers)]
        params = {f"model.layers.{first + i}.{name}": param
                  for i, layer in enumerate(layers) for name, param in layer.named_parameters()}
        indices = "|".join(str(first + i) for i in range(len(layers)))
        mtp_names = re.compile(rf"model\.layers\.(?:{indices})\..+")
        # The checkpoint may store copies of the shared embedding and head in each MTP layer:
        # they must be the target's (Jackfield runs the target's).
        shared = {"embed_tokens.weight": self.model.embed_tokens.weight,
                  "shared_head.head.weight": self.head_weight}
        differing: list[str] = []

        def mtp_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in iter_checkpoint(model_dir, keep=mtp_names.fullmatch):
                target = next((w for suffix, w in shared.items() if name.endswith("." + suffix)), None)
                if target is None:
                    yield name, tensor
                elif not torch.equal(tensor.to(target.device, target.dtype), target):
                    differing.append(name)

        load_weights(params, mtp_tensors(), DEEPSEEK_WEIGHTS)
        if differing:
            raise ValueError(f"{model_dir}: {', '.join(differing)} differ from the target's embedding and "
                             "head, which the multi-token-prediction layers share")
        for layer in layers:
            layer.self_attn.finish_loading()
        self.model.layers.extend(layers)
        self.num_loaded_mtp_layers = len(layers)

    def _mtp_layer(self, layer: int) -> MTPLayer:
        if not 0 <= layer < self.num_loaded_mtp_layers:
            raise ValueError(f"MTP layer {layer} of {self.num_loaded_mtp_layers} loaded")
        return self.model.layers[self.arch.num_layers + layer]

    def mtp_forward(self, layer: int, step: StepContext, input_ids: torch.Tensor, positions: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
        mtp = self._mtp_layer(layer)
        embedded = self.embed(input_ids).masked_fill((positions == 0).unsqueeze(1), 0.0)
        x = mtp.eh_proj(torch.cat((mtp.enorm(embedded), mtp.hnorm(hidden)), dim=-1))
        attn_out = mtp.self_attn.attend(step, *mtp.before_attention(x, positions, self.rope))
        return mtp.after_attention(x, attn_out)

    def mtp_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self._mtp_layer(layer).shared_head.norm(x))
