"""`jackfield bench`: offline latency and throughput of a model at several batch sizes (as `vllm
bench latency` / `throughput`): random prompts of --input-len tokens, --output-len greedy tokens
each (EOS ignored), timed over --num-iters batches after --warmup-iters, a table or --json."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jackfield.commands.run import add_config_flags, config_overrides


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="offline latency and throughput at several batch sizes",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="a jackfield TOML file (default: built-in defaults)")
    parser.add_argument("--model", help="a local Hugging Face model directory or GGUF file")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32],
                        help="requests submitted together (one row of the table each)")
    parser.add_argument("--num-iters", type=int, default=3, help="timed batches per batch size")
    parser.add_argument("--warmup-iters", type=int, default=1, help="untimed batches first")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    add_config_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    import random

    from jackfield.contracts.sampler import SamplingParams
    from jackfield.engine.llm import LLM

    for name in ("input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_iters < 0 or min(args.batch_size) < 1:
        raise ValueError("--warmup-iters must be >= 0 and every --batch-size >= 1")
    llm = LLM(args.model, args.config, **config_overrides(args))
    engine = llm.engine
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds "
                         f"max_model_len {engine.max_model_len}")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(args.seed)
    vocab = engine.capabilities.vocab_size
    rows = []
    for batch in args.batch_size:
        latencies, ttfts = [], []
        for iteration in range(args.warmup_iters + args.num_iters):
            # Fresh prompts every batch: a repeated prompt would be served by the prefix cache.
            prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(batch)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if iteration >= args.warmup_iters:
                latencies.append(elapsed)
                ttfts.append(statistics.mean(o.timings.time_to_first_token_s for o in outputs))
        mean = statistics.mean(latencies)
        rows.append({
            "batch_size": batch,
            "latency_s_mean": round(mean, 4),
            "latency_s_p50": round(statistics.median(latencies), 4),
            "latency_s_max": round(max(latencies), 4),
            "time_to_first_token_s": round(statistics.mean(ttfts), 4),
            "output_tokens_per_s": round(batch * args.output_len / mean, 3),
            "total_tokens_per_s": round(batch * (args.input_len + args.output_len) / mean, 3),
            "requests_per_s": round(batch / mean, 3),
        })
    setup = {"model": str(engine.model_dir), "device": str(engine.device),
             "dtype": str(engine.capabilities.dtype).removeprefix("torch."),
             "backends": {role: c.name for role, c in engine.backend_choices.items()},
             "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters}
    if args.json:
        print(json.dumps({**setup, "results": rows}, indent=2))
        return 0
    print(f"model: {setup['model']} ({setup['device']}, {setup['dtype']}), backends {setup['backends']}")
    print(f"input {args.input_len} tokens, output {args.output_len} tokens, {args.num_iters} timed batches "
          f"after {args.warmup_iters} warm-up")
    columns = list(rows[0])
    print(" | ".join(columns))
    print(" | ".join("---" for _ in columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))
    return 0
