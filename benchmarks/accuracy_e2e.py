"""Accuracy study: Jackfield in bf16 against transformers in float32 on the bench's MID model,
beside transformers' own bf16 error, with one kernel choice varied at a time.

Per prompt: the max |logprob difference| over the engine's top-5 first tokens (bench_e2e's
agreement). A random bf16 MoE model has routing knife-edges (a rounding flips an expert choice:
errors of ~1-2 on a few prompts), so the median over prompts is the figure; --dense replaces
every MoE layer with a dense MLP to take the flips out. Findings: benchmarks/notes_accuracy.md.
The variants: the expanded prefill's SDPA in float32 (the CPU's default: a 16-bit fused kernel
rounds the softmax probabilities before their product with v), the shared prefill's SDPA backend
(cuDNN is PyTorch's first choice on Hopper) and the routed experts' grouped matmul (transformers
loops over experts).

    python3 benchmarks/accuracy_e2e.py [--prompts 8] [--prompt-len 512] [--device cuda] [--dense]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable

import torch
from bench_e2e import MID, agreement


def _float32(q: torch.Tensor) -> torch.dtype:
    return torch.float32


def _own(q: torch.Tensor) -> torch.dtype:
    return q.dtype


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--dense", action="store_true", help="every layer a dense MLP (no routing flips)")
    args = parser.parse_args()
    import jackfield.attention.mla as mla
    import jackfield.models.moe as moe
    from jackfield import LLM
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    dense = dict(MID, first_k_dense_replace=MID["num_hidden_layers"])
    config = DeepseekV3Config(**(dense if args.dense else MID))
    with torch.device(args.device):
        hf = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=gen)
    grouped, attention_dtype = moe.use_grouped_mm, mla.prefill_attention_dtype
    # (label, SDPA without cuDNN, experts as grouped matmuls, prefill attention dtype)
    variants: list[tuple[str, bool, bool, Callable[[torch.Tensor], torch.dtype]]] = [
        ("default", False, True, attention_dtype)
    ]
    if args.device == "cuda":
        variants += [
            ("float32 prefill attention", False, True, _float32),
            ("looped experts", False, False, _own),
            ("no cuDNN SDPA", True, True, _own),
            ("no cuDNN SDPA, looped experts", True, False, _own),
        ]
    else:
        variants += [("bf16 prefill attention (before 2026-11-29)", False, True, _own)]
    with tempfile.TemporaryDirectory(prefix="accuracy_e2e.") as directory:
        hf.save_pretrained(directory)
        # No CUDA graphs: the variants swap functions the graphs would have recorded once (the
        # default's figures are the same with and without graphs: notes_accuracy.md, GPU).
        llm = LLM(
            directory,
            **{
                "engine.device": args.device,
                "model.dtype": "bfloat16",
                "engine.max_num_batched_tokens": args.prompts * args.prompt_len,
                "engine.enable_prefix_caching": False,
                "engine.cpu_kv_cache_gib": 2,
                "engine.cuda_graphs": False,
            },
        )
        print(
            "| variant | Jackfield median | Jackfield max | transformers bf16 median | "
            "transformers bf16 max |"
        )
        print("|---|---|---|---|---|")
        for label, no_cudnn, use_grouped, dtype in variants:
            moe.use_grouped_mm = grouped if use_grouped else (lambda rows: False)
            mla.prefill_attention_dtype = dtype
            if args.device == "cuda":
                torch.backends.cuda.enable_cudnn_sdp(not no_cudnn)
            jf, tf = agreement(llm, hf, prompts, args.device)
            print(
                f"| {label} | {statistics.median(jf):.4f} | {max(jf):.4f} | {statistics.median(tf):.4f} | "
                f"{max(tf):.4f} |",
                flush=True,
            )
    moe.use_grouped_mm, mla.prefill_attention_dtype = grouped, attention_dtype


if __name__ == "__main__":
    main()
