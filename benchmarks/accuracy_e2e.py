"""Accuracy study: Jackfield in bf16 against transformers in float32 on the bench's MID model,
beside transformers' own bf16 error, with one GPU kernel choice varied at a time.

On the H200 (2026-11-29) Jackfield's median first-token error over 8 prompts was 0.19 against
transformers' 0.033 (both have ~0.8 outliers: routing knife-edges of a random bf16 MoE model);
on the CPU the two medians agree (0.032 / 0.028). The variants here say which GPU kernel moves
the median: the shared prefill's SDPA backend (cuDNN is PyTorch's first choice on Hopper) and
the routed experts' grouped matmul (transformers loops over experts with F.linear).

    python3 benchmarks/accuracy_e2e.py [--prompts 8] [--prompt-len 512] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from bench_e2e import MID, agreement


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    import jackfield.models.moe as moe
    from jackfield import LLM
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**MID)
    with torch.device(args.device):
        hf = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    directory = tempfile.mkdtemp(prefix="accuracy_e2e.")
    hf.save_pretrained(directory)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=gen)
    llm = LLM(directory, **{"engine.device": args.device, "model.dtype": "bfloat16",
                            "engine.max_num_batched_tokens": args.prompts * args.prompt_len,
                            "engine.enable_prefix_caching": False, "engine.cpu_kv_cache_gib": 2})
    grouped = moe.use_grouped_mm
    variants = [("default", False, True)]
    if args.device == "cuda":
        variants += [("looped experts", False, False), ("no cuDNN SDPA", True, True),
                     ("no cuDNN SDPA, looped experts", True, False)]
    print("| variant | Jackfield median | Jackfield max | transformers bf16 median | transformers bf16 max |")
    print("|---|---|---|---|---|")
    for label, no_cudnn, use_grouped in variants:
        moe.use_grouped_mm = grouped if use_grouped else (lambda rows: False)
        if args.device == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(not no_cudnn)
        jf, tf = agreement(llm, hf, prompts, args.device)
        print(f"| {label} | {statistics.median(jf):.4f} | {max(jf):.4f} | {statistics.median(tf):.4f} | "
              f"{max(tf):.4f} |", flush=True)
    moe.use_grouped_mm = grouped


if __name__ == "__main__":
    main()
