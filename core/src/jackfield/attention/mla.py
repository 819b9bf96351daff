"""Multi-head latent attention (DeepSeek V2/V3): the base every MLA backend subclasses.

Shapes: H heads, L = kv_lora_rank, N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim.
The cache holds one latent record per token, kv_c [L] ‖ k_pe [R]. Two equivalent forms:
  absorbed (decode, sparse): q_lat = q_nope·W_UK ‖ q_pe attends over the records as keys and their
    kv_c as values (one shared kv "head"), then o = o_lat·W_UV. Cheap when queries are few.
  expanded (prefill): k = kv_c·W_UK^T ‖ k_pe, v = kv_c·W_UV per head, ordinary attention.
`forward` serves one role's rows (the engine divides an MLA batch by role): decode rows through
`decode` (absorbed), prefill rows through `prefill` (expanded). Subclasses implement `attend` (the
absorbed kernel) and may override the public hooks `decode`, `prefill`, `absorb_query`, `write_kv`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jackfield.attention.checks import check_cache, check_kv_scale, check_slot_mapping, check_written_rows
from jackfield.attention.kv_cache import dequantize, quantize, write_slots
from jackfield.contracts.attention import AttentionImpl, AttentionLayerSpec, AttentionMetadata

T = TypeVar("T")

# Not cuDNN, PyTorch's first choice on Hopper: it builds a plan per new shape, and every prompt
# length is a new shape (H200: ~65 ms added to the first token of each new length, against a
# 4-5 ms prefill of the default model). Flash and memory-efficient kernels need no plans.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class MLAImpl(AttentionImpl):
    kind = "mla"

    def __init__(self, layer: AttentionLayerSpec) -> None:
        super().__init__(layer)
        dims = (
            layer.num_heads,
            layer.kv_lora_rank,
            layer.qk_nope_head_dim,
            layer.qk_rope_head_dim,
            layer.v_head_dim,
        )
        if min(dims) <= 0:
            raise ValueError(
                f"MLA layer needs positive num_heads, kv_lora_rank, nope, rope, v dims; got {dims}"
            )
        if layer.head_size != layer.kv_lora_rank + layer.qk_rope_head_dim:
            raise ValueError(
                f"MLA head_size {layer.head_size} must be kv_lora_rank + rope dim = "
                f"{layer.kv_lora_rank + layer.qk_rope_head_dim}"
            )
        self.W_UK: torch.Tensor | None = None  # [H, N, L] float32: q_nope -> latent query
        self.W_UV: torch.Tensor | None = None  # [H, L, V] float32: latent output -> v space
        self._kv_b: dict[torch.dtype, torch.Tensor] = {}  # dtype -> expansion weight [H*(N+V), L]

    def process_weights_after_loading(self, weights: dict[str, torch.Tensor]) -> None:
        """Split HF `kv_b_proj.weight` [H*(N+V), L] once into W_UK and W_UV."""
        if "kv_b_proj" not in weights:
            raise KeyError(f"MLA needs weights['kv_b_proj']; got keys {sorted(weights)}")
        lay = self.layer
        h, n, v, lat = lay.num_heads, lay.qk_nope_head_dim, lay.v_head_dim, lay.kv_lora_rank
        w = weights["kv_b_proj"]
        if tuple(w.shape) != (h * (n + v), lat):
            raise ValueError(f"kv_b_proj must be [{h * (n + v)}, {lat}] (H*(N+V), L), got {list(w.shape)}")
        # kv_b_proj's own layout is the expanded prefill's weight: kept as loaded (no copy).
        self._kv_b = {w.dtype: w.detach()}
        w = w.detach().float().reshape(h, n + v, lat)
        self.W_UK = w[:, :n].contiguous()
        self.W_UV = w[:, n:].transpose(1, 2).contiguous()

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.W_UK is None or self.W_UV is None:
            raise RuntimeError("MLA weights are not loaded: call process_weights_after_loading first")
        return self.W_UK, self.W_UV

    def _kv_b_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The expansion weight [H * (N + V), L] (kv_b_proj's layout: W_UK ‖ W_UV^T per head) in
        `dtype`: the expanded prefill makes every head's k_nope and v with one matmul. The loaded
        weight serves its own dtype; another dtype is converted once."""
        if dtype not in self._kv_b:
            if not self._kv_b:
                raise RuntimeError("MLA weights are not loaded: call process_weights_after_loading first")
            self._kv_b[dtype] = next(iter(self._kv_b.values())).to(dtype)
        return self._kv_b[dtype]

    def forward(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One role's rows: q [T, H, N+R], kv_c [T, L], k_pe [T, R] -> [T, H, V] in q's dtype.

        Writes the rows' latent KV, then attends in the form their role calls for: `decode`
        (absorbed) when every request is a decode (metadata.num_decodes == num_reqs) and for
        sparse rows (`topk_indices`) of either role; `prefill` (expanded) when none is. The
        engine divides an MLA batch by role before it gets here (GroupMetadataBuilder in
        jackfield.attention.metadata), so a batch of decodes and prefills together is refused.
        """
        lay = self.layer
        want = (q.shape[0], lay.num_heads, lay.qk_nope_head_dim + lay.qk_rope_head_dim)
        if q.dim() != 3 or tuple(q.shape[1:]) != want[1:]:
            raise ValueError(f"q must be [T, {want[1]}, {want[2]}] (H, N+R), got {list(q.shape)}")
        num_decodes, num_reqs = metadata.num_decodes, metadata.num_reqs
        if num_decodes not in (0, num_reqs):
            raise ValueError(
                f"MLAImpl.forward serves one role's rows; got {num_decodes} decodes among {num_reqs} "
                "requests (divide the batch by role first, as "
                "jackfield.attention.metadata.GroupMetadataBuilder does)"
            )
        self.write_kv(kv_cache, metadata.slot_mapping, kv_c, k_pe, kv_scale)
        if num_decodes or topk_indices is not None:
            return self.decode(q, kv_cache, metadata, kv_scale=kv_scale, topk_indices=topk_indices)
        return self.prefill(q, kv_cache, metadata, kv_scale=kv_scale)

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """[t, H, N+R] -> latent query [t, H, L+R] in q's dtype (the product in float32)."""
        w_uk, _ = self._weights()
        n = self.layer.qk_nope_head_dim
        q_nope_lat = torch.bmm(q[..., :n].float().transpose(0, 1), w_uk).transpose(0, 1)  # heads batched
        return torch.cat([q_nope_lat.to(q.dtype), q[..., n:]], dim=-1)

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed-form attention of decode rows (and of sparse rows of either role) over the
        cache, which already holds their KV: `attend` with the latent query (`absorb_query`),
        then W_UV. A backend overrides this hook (or just `attend` and `absorb_query`) to apply
        the weights its own way. q [T, H, N+R] -> [T, H, V] in q's dtype.
        """
        _, w_uv = self._weights()
        o_lat = self.attend(
            self.absorb_query(q), kv_cache, metadata, kv_scale=kv_scale, topk_indices=topk_indices
        ).out
        return torch.bmm(o_lat.float().transpose(0, 1), w_uv).transpose(0, 1).to(q.dtype)

    def prefill(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expanded-form attention of prefill rows over each request's whole latent context.

        The requests are padded to one batch [B, H, rows, keys] and run through one SDPA call:
        a plain causal call when every request is a whole causal prompt, else an
        explicit visibility mask, in prefill_attention_dtype. Padded rows and keys are never read
        back. Returns [T, H, V] in q's dtype.
        """
        lay = self.layer
        check_cache(lay, kv_cache)
        check_kv_scale(kv_cache, kv_scale)
        out_dtype = q.dtype
        block_size = kv_cache.shape[1]
        if metadata.block_table.shape[1] * block_size < metadata.max_seq_len:
            raise ValueError(
                f"block_table has {metadata.block_table.shape[1]} blocks of {block_size}, "
                f"too few for seq_len {metadata.max_seq_len}"
            )
        num_reqs, max_q = metadata.num_reqs, metadata.max_query_len
        plan = _memo(metadata, f"mla_prefill_{block_size}",
                     lambda: _prefill_plan(metadata, block_size, q.shape[0]))
        context = kv_cache.flatten(0, 1)[plan.slots]  # [B, S, L+R]
        # Expanded in the activation dtype (float32 on the CPU, bf16 on GPUs: the checkpoint's own).
        context = context if context.dtype == q.dtype else dequantize(context, kv_scale).to(q.dtype)
        # padded keys read slot 0: zero them (a NaN there survives a mask in P.V)
        if plan.padding is not None:
            context.masked_fill_(plan.padding[..., None], 0)
        kv_c, k_pe = context[..., : lay.kv_lora_rank], context[..., lay.kv_lora_rank :]
        h, n, width = lay.num_heads, lay.qk_nope_head_dim, lay.qk_nope_head_dim + lay.qk_rope_head_dim
        b, s = kv_c.shape[:2]
        kv = F.linear(kv_c, self._kv_b_in(q.dtype)).view(b, s, h, n + lay.v_head_dim)
        # k and v are new tensors either way (a concatenation, a padding): built in the attention
        # dtype, they cost no conversion of their own.
        dtype = prefill_attention_dtype(q)
        k = torch.cat([kv[..., :n], k_pe[:, :, None].expand(-1, -1, h, -1).to(dtype)], dim=-1).transpose(1, 2)
        if q.device.type == "cpu":
            # v padded to k's width: the CPU's flash kernel wants one head size (float32 there,
            # so the probabilities are not rounded), else SDPA falls back to its math path.
            v = kv.new_zeros(b, s, h, width, dtype=dtype)
            v[..., : lay.v_head_dim] = kv[..., n:]
        else:
            # v at its own width, as transformers calls SDPA: FlashAttention (one head size)
            # declines, the memory-efficient kernel serves. With v padded (flash) the H200 bench's
            # first-token logprob error was 2.2x this call's (0.24 against 0.11, both against a
            # reference later found to round its RoPE: benchmarks/notes_accuracy.md).
            v = kv[..., n:].to(dtype)
        v = v.transpose(1, 2)
        rows = plan.rows  # None: every request has max_q rows, the packed rows are the batch
        q = q.to(dtype)
        if rows is not None:
            q = q.new_zeros(num_reqs * max_q, lay.num_heads, width).index_copy_(0, rows, q)
        padded = q.reshape(num_reqs, max_q, lay.num_heads, width).transpose(1, 2)
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            if metadata.causal and lay.sliding_window is None and plan.whole_prompts:
                out = F.scaled_dot_product_attention(padded, k, v, is_causal=True, scale=lay.scale)
            else:
                window = lay.sliding_window
                visible = _memo(metadata, f"mla_visible_{window}",
                                lambda: _visibility(metadata, max_q, metadata.max_seq_len, window))
                out = F.scaled_dot_product_attention(padded, k, v, attn_mask=visible[:, None],
                                                     scale=lay.scale)
        # One copy back to the rows' layout, v's width and the activation dtype.
        packed = out.new_empty(num_reqs * max_q, lay.num_heads, lay.v_head_dim, dtype=out_dtype)
        out = out.transpose(1, 2)[..., : lay.v_head_dim]
        packed.view(num_reqs, max_q, lay.num_heads, lay.v_head_dim).copy_(out)
        return packed if rows is None else packed[rows]

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """key = kv_c [T, L], value = k_pe [T, R]; stored as one record kv_c ‖ k_pe per slot."""
        lay = self.layer
        check_cache(lay, kv_cache)
        check_kv_scale(kv_cache, kv_scale)
        num_tokens = key.shape[0] if key.dim() else 0
        check_written_rows("kv_c", key, (num_tokens, lay.kv_lora_rank), kv_cache)
        check_written_rows("k_pe", value, (num_tokens, lay.qk_rope_head_dim), kv_cache)
        padded = check_slot_mapping(slot_mapping, num_tokens, kv_cache.shape[0] * kv_cache.shape[1])
        record = quantize(torch.cat([key.float(), value.float()], dim=-1), kv_cache.dtype, kv_scale)
        write_slots(kv_cache.flatten(0, 1), slot_mapping, record, padded)


def prefill_attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the expanded prefill runs SDPA in: float32 on the CPU, else q's own.

    A fused 16-bit SDPA kernel (the CPU's flash kernel; FlashAttention and cuDNN on GPUs) rounds
    the softmax probabilities to 16 bits before their product with v: a second rounding beside
    the output's, 10-15% more error in a layer's attention output than rounding once. On the CPU
    transformers never takes that kernel for MLA (flash wants v as wide as k): its math path
    upcasts to float32. The CPU's float32 flash kernel runs at about the bf16 kernel's speed, so
    there the probabilities stay float32 and the output rounds once (benchmarks/notes_accuracy.md).
    GPUs have no float32 tensor-core attention: the 16-bit kernel stays (accuracy_e2e.py's
    "float32 prefill attention" variant measures what it costs there)."""
    return torch.float32 if q.device.type == "cpu" else q.dtype


@dataclass(frozen=True)
class _PrefillPlan:
    """What every layer's expanded prefill of one step shares (built by the first layer)."""

    slots: torch.Tensor  # [B, S] cache rows of each request's context (0 past its seq_len)
    padding: torch.Tensor | None  # [B, S] True past a request's seq_len (None: every request is S long)
    rows: torch.Tensor | None  # [T] each packed query row's place in the padded [B * max_q] batch
    whole_prompts: bool  # every request is its whole prompt (a plain causal SDPA call)


def _memo(metadata: AttentionMetadata, key: str, build: Callable[[], T]) -> T:
    """`build()` once per step: every layer of a step shares metadata.extra, so the first layer's
    result is kept there, with the tensors it was built from. A hit needs those very tensors,
    unmodified: metadata copied with other lengths (`replace`) shares `extra` but builds its own."""
    sources = (metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
               metadata.seq_lens_cpu, metadata.query_start_loc_cpu)
    if any(t.is_inference() for t in sources):  # no version counter to trust: build every time
        return build()
    stamp = [(t, t._version) for t in sources]
    scalars = (metadata.max_query_len, metadata.max_seq_len, metadata.num_decodes,
               metadata.num_decode_tokens, metadata.causal)
    kept = metadata.extra.get(key)
    if (kept is not None and kept[1] == scalars
            and all(a is b and v == w for (a, v), (b, w) in zip(kept[0], stamp, strict=True))):
        return kept[2]  # type: ignore[return-value]
    value = build()
    metadata.extra[key] = (stamp, scalars, value)
    return value


def _prefill_plan(metadata: AttentionMetadata, block_size: int, num_rows: int) -> _PrefillPlan:
    pos = torch.arange(metadata.max_seq_len, device=metadata.block_table.device)
    slots = metadata.block_table[:, pos // block_size].long() * block_size + pos % block_size
    valid = pos < metadata.seq_lens[:, None]
    slots = torch.where(valid, slots, 0)
    padding = None if bool((metadata.seq_lens_cpu == metadata.max_seq_len).all()) else ~valid
    q_lens = metadata.query_start_loc_cpu.diff()
    whole_prompts = bool((q_lens == metadata.seq_lens_cpu).all())
    uniform = num_rows == metadata.num_reqs * metadata.max_query_len  # no request is short
    rows = None if uniform else _padded_rows(metadata.query_start_loc, num_rows, metadata.max_query_len)
    return _PrefillPlan(slots, padding, rows, whole_prompts)


def _padded_rows(query_start_loc: torch.Tensor, num_rows: int, max_q: int) -> torch.Tensor:
    """Where each packed query row sits in the [B * max_q] padded batch (on the device, no sync)."""
    device = query_start_loc.device
    q_lens = query_start_loc.diff()
    req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens, output_size=num_rows)
    return req * max_q + torch.arange(num_rows, device=device) - query_start_loc[req].long()


def _visibility(
    metadata: AttentionMetadata, max_q: int, max_k: int, sliding_window: int | None
) -> torch.Tensor:
    """[B, max_q, max_k] bool: query row i of request b (position seq_len - q_len + i) sees key j."""
    device = metadata.seq_lens.device
    seq_lens = metadata.seq_lens.long()[:, None, None]
    q_lens = metadata.query_start_loc.diff().long()[:, None, None]
    q_pos = seq_lens - q_lens + torch.arange(max_q, device=device)[None, :, None]
    k_pos = torch.arange(max_k, device=device)[None, None, :]
    visible = k_pos < seq_lens
    if metadata.causal:
        visible = visible & (k_pos <= q_pos)
    if sliding_window is not None:
        visible = visible & (k_pos > q_pos - sliding_window)
    return visible
