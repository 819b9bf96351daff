"""Training an EAGLE-3 head ("training-time test", as the EAGLE-3 paper and SpecForge train it):
the head the benchmark trains (benchmarks/train_eagle3.py) and the checkpoint it writes, shared
with the test that checks the trained function is the one the `eagle3` drafter computes.

Over a teacher-forced sequence the head is unrolled for a few steps at every anchor p at once:
step 0 reads fc(taps at p) with the token at p + 1 at position p (a verified row of the engine);
step s >= 1 reads step s - 1's output with the token at p + 1 + s at position p + s (the row
that drafts token s), attending step 0's keys at positions <= p and its own chain's keys of
steps 1..s, as the drafter's KV cache holds them when it drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

# Head parameter -> its name in the published layout (`midlayer.*` unless listed at the top).
_TOP = ("fc.weight", "norm.weight", "lm_head.weight")
_LAYER_NAMES = {
    "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
    "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}


def rope_theta(cfg: dict) -> float:
    """The target's RoPE base from its config.json (transformers 5: `rope_parameters`; 4: top level)."""
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


class Eagle3TrainingHead(nn.Module):
    """The head being trained (float32 master weights), for a target with config.json `cfg`."""

    def __init__(self, cfg: dict, draft_vocab: int) -> None:
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or h // heads
        eps = cfg["rms_norm_eps"]
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm, self.hidden_norm = nn.RMSNorm(h, eps), nn.RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h, eps)
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.norm = nn.RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.rope_theta = rope_theta(cfg)
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, d] at positions [T] (Llama's half-split rotation)."""
        angles = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def step(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             chain: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One unrolled step over every anchor [B, T]: `chain` holds the keys and values of the
        steps before (step 0's first), and gets this step's."""
        b, t, _ = hidden.shape
        z = torch.cat((self.input_layernorm(embedded), self.hidden_norm(hidden)), -1)
        q = self.rope(self.q_proj(z).view(b, t, self.heads, self.head_dim).transpose(1, 2), positions)
        k = self.rope(self.k_proj(z).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), positions)
        v = self.v_proj(z).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        chain.append((k, v))
        scale = self.head_dim**-0.5
        k0, v0 = chain[0]
        scores0 = (q @ k0.transpose(-1, -2)) * scale  # anchor p sees step 0's positions <= p
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores0 = scores0.masked_fill(~causal, -torch.inf)
        own = torch.stack([(q * ks).sum(-1) * scale for ks, _ in chain[1:]], -1) if len(chain) > 1 else None
        scores = scores0 if own is None else torch.cat((scores0, own), -1)
        probs = scores.float().softmax(-1).to(q.dtype)
        out = probs[..., :t] @ v0
        if own is not None:
            out = out + (probs[..., t:, None] * torch.stack([vs for _, vs in chain[1:]], -2)).sum(-2)
        r = self.o_proj(out.transpose(1, 2).reshape(b, t, -1)) + hidden
        x = self.post_attention_layernorm(r)
        return r + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def unroll(self, tapped: torch.Tensor, embedded: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Each step's output (before `norm`) at every anchor p: step s drafts the token at
        p + 2 + s. `tapped` [B, T, 3H]: the target's tapped layer inputs at each position, in
        the order of the checkpoint's tap layers; `embedded` [B, T, H]: the sequence's token
        embeddings. Anchors whose step reads past the sequence see zeros there."""
        t = tapped.shape[1]
        hidden = self.fc(tapped)
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        for s in range(steps):
            shift = 1 + s
            emb = F.pad(embedded[:, shift:], (0, 0, 0, shift))
            hidden = self.step(emb, hidden, torch.arange(t, device=tapped.device) + s, chain)
            outs.append(hidden)
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of outputs `out`."""
        return self.lm_head(self.norm(out))


@torch.no_grad()
def init_from_target(head: Eagle3TrainingHead, target: nn.Module, draft_ids: torch.Tensor) -> None:
    """Start `head` as the target's last decoder layer over the deepest tap, read out through the
    target's final norm and its output rows of the draft vocabulary (`draft_ids`: the target id of
    each draft id). `target`: a transformers Llama-like causal LM of the head's shapes.

    fc passes the last of the three taps through (the others start at zero); the layer's hidden
    half of q/k/v and hidden_norm are the target layer's attention input and its norm, the
    embedding half starts at zero; o_proj, the MLP and its norm are the target layer's. Step 0 of
    the head at the start is then exactly the target's last layer applied to that tap: its
    attention already reads the context as the target's does, and what training adds is the
    drafted token's embedding and the shift by one position."""
    h = head.fc.in_features // 3
    layer = target.model.layers[-1]
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * h :] = torch.eye(h, device=head.fc.weight.device)
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(head, name).weight
        weight.zero_()
        weight[:, h:] = getattr(layer.self_attn, name).weight  # z = cat(embedding, hidden)
    head.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(head, name).weight.copy_(getattr(layer.mlp, name).weight)
    head.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    head.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    head.norm.weight.copy_(target.model.norm.weight)
    head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])


def save_head(head: Eagle3TrainingHead, cfg: dict, draft_ids: torch.Tensor, vocab: int,
              taps: tuple[int, ...], directory: Path) -> None:
    """The published layout: fc, midlayer.*, norm, lm_head, d2t (target = i + d2t[i]), t2d; bf16
    weights. `draft_ids`: the target id of each draft id (ascending)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {(name if name in _TOP else "midlayer." + _LAYER_NAMES.get(name, name)):
               p.detach().to(torch.bfloat16).cpu().contiguous() for name, p in head.named_parameters()}
    ids = draft_ids.cpu()
    tensors["d2t"] = ids - torch.arange(len(ids))
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        **{key: cfg[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                                     "vocab_size") if key in cfg},
        "head_dim": head.head_dim,
        # the RoPE the head was trained with (a transformers 4 config.json has no rope_parameters)
        "rope_parameters": {"rope_type": "default", "rope_theta": head.rope_theta},
        "draft_vocab_size": len(ids), "target_hidden_size": cfg["hidden_size"], "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps)},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
