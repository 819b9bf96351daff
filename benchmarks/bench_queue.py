"""Does an engine step cost more with a longer queue of waiting requests? (issue 18, s38)

vLLM's and SGLang's users submit 10^4-10^5 requests at once; the cost of a step must not grow with
the requests waiting behind the running ones, nor with those already finished. This queues N
prompts at once through `LLM.generate` (continuous batching, `engine.max_num_seqs` rows a step)
for each N asked, and prints the time a request and the median step time while the queue is
long (its first tenth of steps), half gone and nearly empty. Flat figures across N say no step
does work over the queue; "outside" is the time spent outside the steps (validating and queuing
the requests, then the outputs), which grows with N by design.

The model is a random tiny Llama (bench_host's) on the CPU, or SmolLM2-135M's shapes on CUDA.
--host-only (the CPU) replaces the forward by zeros, so a busy shared machine's preemptions,
landing mostly in the forward, stay out of the host figures.

  python benchmarks/bench_queue.py --host-only                 # CPU: 1k, 5k, 20k prompts
  python benchmarks/bench_queue.py --device cuda --counts 2000 16000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_host import TINY, forward_of_zeros, tiny_model
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import write_granite

# SmolLM2-135M's shapes (train_eagle3's target)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=2304, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
PHASES = ((0.0, 0.1, "queue long"), (0.45, 0.55, "half gone"), (0.8, 0.9, "nearly empty"))


def model_dir(device: str) -> tuple[str, int]:
    """A random checkpoint for the device, and its vocabulary size."""
    if device == "cpu":
        return tiny_model("llama", 256), TINY["vocab_size"]
    directory = Path(tempfile.mkdtemp(prefix="bench_queue."))
    write_granite("llama", directory, **SMOLLM2)
    return str(directory), SMOLLM2["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 5000, 20000], help="prompts queued")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 64 (CPU), 512 (CUDA)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[20, 60], help="drawn from this range")
    parser.add_argument("--host-only", action="store_true", help="a forward of zeros (the CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    directory, vocab = model_dir(args.device)
    seqs = args.max_num_seqs or (512 if args.device == "cuda" else 64)
    settings: dict[str, object] = {"engine.device": args.device, "engine.max_num_seqs": seqs,
                                   "engine.enable_prefix_caching": False,  # as train_eagle3's data engine
                                   "model.dtype": "bfloat16" if args.device == "cuda" else "float32"}
    if args.device == "cpu":
        settings["engine.max_model_len"] = 256  # the tiny checkpoint's positions
    else:  # the KV budget of train_eagle3's data engine
        settings["engine.gpu_memory_fraction"] = 0.2
    llm = LLM(directory, **settings)
    engine = llm.engine
    if args.host_only:
        forward_of_zeros(engine)
    steps: list[tuple[int, float]] = []  # (requests waiting before the step, its seconds)
    step = engine.step

    def timed_step() -> list:
        waiting, start = len(engine.scheduler.waiting), time.perf_counter()
        finished = step()
        steps.append((waiting, time.perf_counter() - start))
        return finished

    engine.step = timed_step  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    low, high = args.prompt_len
    print(f"seed {args.seed}, device {args.device}, {seqs} rows a step, prompts of {low}-{high} tokens, "
          f"{args.max_tokens} new tokens each{', host only' if args.host_only else ''}")
    print("| prompts | seconds | ms a request | steps | outside the steps s | "
          + " | ".join(f"median step ms, {name}" for _, _, name in PHASES) + " |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(PHASES))
    for count in args.counts:
        lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
        steps.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        inside = sum(s for _, s in steps)
        medians = []
        for lo, hi, _ in PHASES:
            part = steps[int(lo * len(steps)) : max(int(hi * len(steps)), int(lo * len(steps)) + 1)]
            medians.append(f"{1e3 * statistics.median(s for _, s in part):.2f} "
                           f"(queue {part[0][0]}-{part[-1][0]})")
        print(f"| {count} | {seconds:.2f} | {1e3 * seconds / count:.3f} | {len(steps)} | "
              f"{seconds - inside:.2f} | " + " | ".join(medians) + " |", flush=True)


if __name__ == "__main__":
    main()
