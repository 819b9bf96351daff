"""DeepSeek-V3.2: DeepSeek-V3 plus the lightning indexer (DeepSeek Sparse Attention).

Per layer, the indexer scores every visible past token for each query,
    score[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s] / sqrt(D_I)),   w = weights_proj(x) / sqrt(H_I)
and MLA attends to the `index_topk` best (the backend's sparse path, absorbed form). The indexer
keys (one [D_I] vector per token, RoPE on the first rope_dim dims, half-split layout) live in a
paged cache of their own with the same blocks and slots as the layer's latent KV: the model's
`kv_cache_layers` lists the L latent caches, then the L indexer-key caches.
Everything else (MoE, MLA projections, weights) is the DeepSeek-V3 model. Under tensor
parallelism the indexer is replicated (every rank picks the same top-k) while MLA's heads split.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from jackfield.attention.checks import check_slot_mapping
from jackfield.attention.kv_cache import request_slots, write_slots
from jackfield.contracts.attention import (
    AttentionBackends,
    AttentionLayerSpec,
    AttentionMetadata,
    KVCacheDType,
    StepContext,
)
from jackfield.models.deepseek import DeepseekForCausalLM, MLAAttention
from jackfield.models.hf_config import DeepseekArch, rope_inv_freq
from jackfield.models.layers import Linear, RotaryEmbedding


class Indexer(nn.Module):
    def __init__(self, arch: DeepseekArch, dtype: torch.dtype) -> None:
        super().__init__()
        heads, dim = arch.index_n_heads, arch.index_head_dim
        self.heads, self.dim, self.topk, self.rope_dim = heads, dim, arch.index_topk, arch.qk_rope_head_dim
        assert arch.q_lora_rank is not None  # deepseek_arch checked it: the indexer reads the q latent
        self.wq_b = Linear(arch.q_lora_rank, heads * dim, dtype)
        self.wk = Linear(arch.hidden_size, dim, dtype)
        self.k_norm = nn.Module()  # LayerNorm with bias, eps 1e-6
        self.k_norm.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        self.k_norm.bias = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        # Head weights in float32 whatever the activation dtype (as the reference keeps them).
        self.weights_proj = nn.Module()
        self.weights_proj.weight = nn.Parameter(
            torch.empty(heads, arch.hidden_size, dtype=torch.float32), False
        )

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        return torch.cat((rope(x[..., : self.rope_dim], positions), x[..., self.rope_dim :]), dim=-1)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the layer's normed input x: the indexer queries [T, H_I, D_I] and keys [T, D_I]
        (roped) and the head weights [T, H_I] float32."""
        t = x.shape[0]
        q = self._rope(self.wq_b(q_latent).view(t, self.heads, self.dim), positions, rope)
        k = F.layer_norm(
            self.wk(x).float(), (self.dim,), self.k_norm.weight.float(), self.k_norm.bias.float(), 1e-6
        )
        k = self._rope(k.to(x.dtype).unsqueeze(1), positions, rope).squeeze(1)
        head_weights = F.linear(x.float(), self.weights_proj.weight) * self.heads**-0.5
        return q, k, head_weights

    def top_k(self, q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor, key_cache: torch.Tensor,
              metadata: AttentionMetadata) -> torch.Tensor:
        """Write the rows' indexer keys, then top-k indices [T, K] int32 (request-local key
        positions, -1 where a query sees fewer than K keys)."""
        t = q.shape[0]
        flat = key_cache.flatten(0, 1)
        padded = check_slot_mapping(metadata.slot_mapping, t, flat.shape[0])
        write_slots(flat, metadata.slot_mapping, k.to(key_cache.dtype), padded)
        width = min(self.topk, metadata.max_seq_len)
        out = torch.full((t, width), -1, dtype=torch.int32, device=q.device)
        qsl = metadata.query_start_loc_cpu.tolist()
        for b, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
            q0, q1 = qsl[b], qsl[b + 1]
            if q0 == q1:
                continue
            keys = flat[request_slots(metadata.block_table[b], seq_len, key_cache.shape[1])].float()  # [S, D]
            scores = F.relu(torch.einsum("qhd,sd->qhs", q[q0:q1].float(), keys) * self.dim**-0.5)
            scores = torch.einsum("qh,qhs->qs", head_weights[q0:q1], scores)
            query_pos = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)[:, None]
            visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos
            best = scores.masked_fill(~visible, float("-inf")).topk(min(width, seq_len), dim=-1)
            indices = torch.where(torch.isfinite(best.values), best.indices, -1)
            out[q0:q1, : indices.shape[1]] = indices.to(torch.int32)
        return out


class SparseMLAAttention(MLAAttention):
    """MLA whose queries attend only to the indexer's top-k tokens."""

    def __init__(
        self,
        arch: DeepseekArch,
        index: int,
        spec: AttentionLayerSpec,
        backends: AttentionBackends,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(arch, index, spec, backends, dtype)
        self.indexer = Indexer(arch, dtype)

    def project_sparse(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                       index_rope: RotaryEmbedding) -> tuple[torch.Tensor, ...]:
        """The attention's inputs from the normed x: q, kv_c, k_pe, then the indexer's q, k and
        head weights."""
        q, kv_c, k_pe, q_latent = self.project(x, positions, rope)
        assert q_latent is not None
        return (q, kv_c, k_pe, *self.indexer.project(x, q_latent, positions, index_rope))

    def attend(self, step: StepContext, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,  # type: ignore[override]
               index_q: torch.Tensor, index_k: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
        a = self.arch
        cache = step.kv_caches[self.index]
        key_cache = step.kv_caches[a.num_layers + self.index]  # same blocks and slots as `cache`
        out = q.new_empty(q.shape[0], self.num_heads, a.v_head_dim)  # this rank's heads
        kv_scale = self.attn.kv_scale(step, self.index, kv_c, k_pe)
        # The engine's parts of the batch (its role halves, this layer's KV cache group): the
        # indexer picks each part's top-k with that part's metadata, then its impl attends.
        for rows, impl, metadata in self.attn.parts(step, self.index):
            topk = self.indexer.top_k(index_q[rows], index_k[rows], head_weights[rows], key_cache, metadata)
            out[rows] = impl.forward(q[rows], kv_c[rows], k_pe[rows], cache, metadata, kv_scale=kv_scale,  # type: ignore[attr-defined]
                                     topk_indices=topk)
        return out


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    def _cuda_graph_safe(self) -> bool:
        return False  # the indexer's top-k (in attend) reads lengths on the host: no decode graphs

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backends: AttentionBackends,
        dtype: torch.dtype,
        kv_cache_dtype: KVCacheDType = "auto",
    ) -> None:
        super().__init__(hf_config, backends, dtype, kv_cache_dtype)
        arch = self.arch
        # The indexer's RoPE: the MLA frequencies, half-split pairs (not interleaved).
        inv_freq, scaling = rope_inv_freq(hf_config, arch.qk_rope_head_dim)
        self.index_rope = RotaryEmbedding(inv_freq, scaling, arch.max_position_embeddings, interleaved=False)
        # One record of index_head_dim values per token: the MLA cache layout with no rope part.
        self.index_key_spec = AttentionLayerSpec(
            num_heads=arch.index_n_heads,
            head_size=arch.index_head_dim,
            scale=arch.index_head_dim**-0.5,
            kv_lora_rank=arch.index_head_dim,
        )

    def load_mtp_layers(self, model_dir: str | Path) -> None:
        raise ValueError(f"{model_dir}: DeepSeek-V3.2's multi-token-prediction layers (with their indexer) "
                         "are not supported")

    def make_attention(self, index: int, backends: AttentionBackends) -> MLAAttention:
        return SparseMLAAttention(self.arch, index, self.attention_spec, backends, self.dtype)

    @property
    def kv_cache_layers(self) -> list[AttentionLayerSpec]:
        """The L latent caches, then the L indexer-key caches (same blocks and slots)."""
        return [self.attention_spec] * self.arch.num_layers + [self.index_key_spec] * self.arch.num_layers

    def before_attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer = self.model.layers[i]
        return layer.self_attn.project_sparse(layer.input_layernorm(x), positions, self.rope, self.index_rope)
