"""The embedded default model: a tiny random DeepSeek-V3 written on first use, no network.

transformers' own DeepseekV3ForCausalLM builds it from a fixed seed and save_pretrained writes it
into the cache dir (~/.cache/jackfield, or $JACKFIELD_CACHE), with a byte-level tokenizer beside
it; the engine then loads it like any other checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from jackfield.gguf_files import cache_dir

DEFAULT_MODEL_NAME = "tiny-deepseek-v3-r2"  # bump the suffix when the recipe below changes
SEED = 20261129
BOS_ID, EOS_ID = 256, 257

TINY_CONFIG = dict(
    vocab_size=320,  # 256 bytes + 2 specials, padded
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    max_position_embeddings=4096,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    initializer_range=0.1,  # livelier logits than 0.02, so sampled text is not uniform noise
    num_nextn_predict_layers=0,  # no multi-token-prediction layers (transformers' config says 1)
)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def save_byte_tokenizer(directory: Path) -> None:
    """Token id = byte value; 256 <s>, 257 </s>. No merges: every byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    fast.save_pretrained(str(directory))


def default_hf_config() -> dict[str, object]:
    """The default model's config.json contents, without creating the model (for `doctor`)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**TINY_CONFIG)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config.to_dict()


def build_default_model(directory: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    config = DeepseekV3Config(**TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # a live router: transformers starts the expert bias at zero
            for layer in model.model.layers[config.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # `jackfield run` shows its own progress line
    try:
        model.save_pretrained(str(directory))
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    save_byte_tokenizer(directory)


def default_model_dir() -> Path:
    """The default model's directory, created (atomically) on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=DEFAULT_MODEL_NAME + ".", dir=target.parent))
    try:
        build_default_model(staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # another process finishing first is fine
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
