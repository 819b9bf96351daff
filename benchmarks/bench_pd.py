"""Prefill/decode disaggregation (issue 25): time to first token and inter-token latency of a mixed
workload, P/D (`PDLLM`: a prefill engine in a second process, the `pd` KV connector) against one
engine, in one run on the same weights.

Workload (open loop, the same arrival times for both): `--decoders` requests with short prompts
start at t = 0 and decode `--decode-tokens` each; meanwhile `--long` requests with
`--long-tokens`-token prompts arrive every `--interval-s`, each wanting `--long-new` tokens. One
engine interleaves every long prefill (in chunks of max_num_batched_tokens) with the decodes, so
their steps stall; under P/D the decode engine computes at most one block of each prompt and the
prefill engine the rest (on its own GPU with --prefill-device).

Reported per setup: TTFT p50 / p99 of the long requests; inter-token latency (the gap between a
request's consecutive tokens, every request) p50 / p99 / max, split into the decoders' gaps
and the first gap of a long request (under P/D: handoff and KV load); the wall time. The ceiling
given for reference is the host<->device copy rate the KV crosses twice under P/D over gloo.

  python benchmarks/bench_pd.py --device cpu                              # small Llama, here
  python benchmarks/bench_pd.py --device cuda --prefill-device cuda:1 --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_e2e import LLAMA_1B, LLAMA_SMALL, build_hf_model
from jackfield import LLM, SamplingParams
from jackfield.commands.pd import PDLLM
from jackfield.engine.sequence import Sequence


@dataclass(frozen=True)
class Arrival:
    at_s: float
    token_ids: list[int]
    params: SamplingParams
    long: bool


def workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=args.long_new, ignore_eos=True)
    arrivals = [Arrival(0.0, prompt(32), decode, False) for _ in range(args.decoders)]
    arrivals += [Arrival(args.warm_s + i * args.interval_s, prompt(args.long_tokens), long, True)
                 for i in range(args.long)]
    return arrivals


def drive(add: Callable[[list[int], SamplingParams], Sequence], step: Callable[[], object],
          has_work: Callable[[], bool], arrivals: list[Arrival]) -> tuple[list[tuple[Arrival, Sequence,
                                                                                      list[float]]], float]:
    """Submit each arrival at its time, step until everything finished; per request its token
    times (the first: the engine's own first-token time; later ones: when the step returned)."""
    pending = sorted(arrivals, key=lambda a: a.at_s)
    runs: list[tuple[Arrival, Sequence, list[float]]] = []
    start = time.perf_counter()
    while pending or has_work():
        now = time.perf_counter() - start
        while pending and pending[0].at_s <= now:
            arrival = pending.pop(0)
            runs.append((arrival, add(arrival.token_ids, arrival.params), []))
        if not has_work():
            time.sleep(max(0.0, min(0.01, pending[0].at_s - now)))
            continue
        step()
        stamp = time.perf_counter()
        for _, seq, times in runs:
            new = len(seq.output_ids) - len(times)
            if new > 0 and not times and seq.first_token_time is not None:
                times.append(seq.first_token_time)
                new -= 1
            times += [stamp] * new
    return runs, time.perf_counter() - start


def summarize(runs: list[tuple[Arrival, Sequence, list[float]]], wall_s: float) -> dict[str, float]:
    def q(values: list[float], p: int) -> float:
        if len(values) < 2:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


    ttft = [seq.first_token_time - seq.arrival_time for a, seq, _ in runs if a.long]  # type: ignore[operator]
    decode_gaps = [b - a for arr, _, t in runs if not arr.long for a, b in zip(t, t[1:], strict=False)]
    first_gaps = [t[1] - t[0] for arr, _, t in runs if arr.long and len(t) > 1]
    return {"ttft_p50": q(ttft, 50), "ttft_p99": q(ttft, 99), "itl_p50": q(decode_gaps, 50),
            "itl_p99": q(decode_gaps, 99), "itl_max": max(decode_gaps),
            "first_gap_p50": q(first_gaps, 50), "wall_s": wall_s}


def one_engine(directory: str, config: dict[str, object], arrivals: list[Arrival]) -> dict[str, float]:
    engine = LLM(directory, **config).engine
    return summarize(*drive(engine.add_request, engine.step, engine.scheduler.has_work, arrivals))


def copy_rate(device: str) -> float:
    """Host <-> device GB/s of a pinned copy (the ceiling of each of the KV's two host crossings)."""
    if device == "cpu":
        return float("nan")
    host = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * host.numel() / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefill-device", help="the prefill engine's device (e.g. cuda:1)")
    parser.add_argument("--decoders", type=int, default=None)
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--long", type=int, default=None)
    parser.add_argument("--long-tokens", type=int, default=None)
    parser.add_argument("--long-new", type=int, default=4)
    parser.add_argument("--interval-s", type=float, default=None)
    parser.add_argument("--warm-s", type=float, default=0.5, help="decoders run alone this long first")
    parser.add_argument("--append", help="append the results to this markdown file")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    defaults = (16, 256, 6, 8192, 0.3) if cuda else (4, 32, 4, 512, 1.0)
    names = ("decoders", "decode_tokens", "long", "long_tokens", "interval_s")
    for name, value in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    shape = LLAMA_1B if cuda else LLAMA_SMALL
    _, directory = build_hf_model("llama", not cuda, None, "cpu", torch.bfloat16 if cuda else torch.float32)
    config = {"engine.device": args.device, "model.dtype": "bfloat16" if cuda else "float32",
              "engine.block_size": 16, "engine.max_num_seqs": args.decoders + args.long,
              "engine.max_model_len": args.long_tokens + 64,
              "engine.max_num_batched_tokens": 2048 if cuda else 256}
    arrivals = workload(args, shape["vocab_size"])
    results = {"one engine": one_engine(directory, config, arrivals)}
    prefill = {"engine.device": args.prefill_device} if args.prefill_device else None
    with PDLLM(directory, **config, prefill_overrides=prefill,
               **{"kv_connector.options": {"cpu_gib": 32.0 if cuda else 1.0}}) as pd:
        results["P/D"] = summarize(*drive(lambda t, p: pd.add_requests([(t, p)])[0], pd.step, pd.has_work,
                                          arrivals))
        stats, prefill_stats = pd.engine.kv_connector_stats(), pd.producer_stats()
    where = torch.cuda.get_device_name() if cuda else "cpu"
    command = (f"python benchmarks/bench_pd.py --device {args.device}"
               + (f" --prefill-device {args.prefill_device}" if args.prefill_device else ""))
    lines = [
        f"### bench_pd ({datetime.date.today()}, {where}, `{command}`)",
        "",
        f"Llama {'3.2-1B' if cuda else 'small'} shape; {args.decoders} decoders (32-token prompts, "
        f"{args.decode_tokens} tokens each) from t = 0; {args.long} prompts of {args.long_tokens} tokens "
        f"({args.long_new} tokens each) every {args.interval_s} s from t = {args.warm_s} s; "
        f"max_num_batched_tokens {config['engine.max_num_batched_tokens']}; host<->device pinned copy "
        f"{copy_rate(args.device):.1f} GB/s.",
        "",
        "| setup | long TTFT p50 / p99 ms | decoders' ITL p50 / p99 / max ms "
        "| long requests' first gap p50 ms | wall s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ttft_p50'] * 1e3:.1f} / {r['ttft_p99'] * 1e3:.1f} | "
                     f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f} / {r['itl_max'] * 1e3:.1f} | "
                     f"{r['first_gap_p50'] * 1e3:.1f} | {r['wall_s']:.2f} |")
    lines += ["", f"P/D connector: prefill {prefill_stats}; decode {stats}.", ""]
    print("\n".join(lines))
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
