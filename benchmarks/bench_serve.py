"""`jackfield serve` under load: request throughput, time to first token and inter-token latency.

The server runs in this process (uvicorn on 127.0.0.1, a thread) over one engine; clients are
the official `openai` AsyncOpenAI streaming completions, `concurrency` of them at a time, each
sending random token-id prompts. Baseline in the same run: the same requests through the offline
`LLM.generate` of an engine built the same way (no HTTP, no streaming): the server's tokens/s
against it is the cost of serving.

  python benchmarks/bench_serve.py                               # embedded model, CPU
  python benchmarks/bench_serve.py --model DIR --device cuda --concurrency 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time

import openai
import torch
import uvicorn
from jackfield import LLM, SamplingParams
from jackfield.config import resolve_config
from jackfield.engine.async_engine import AsyncEngine
from jackfield.engine.engine import Engine
from jackfield.serving.app import create_app


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(
    client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int
) -> tuple[float, list[float]]:
    """(time to first token, the gaps between later tokens) of one streamed completion."""
    start = time.perf_counter()
    stamps = []
    stream = await client.completions.create(
        model="bench",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> tuple[float, list[float]]:
        async with gate:
            return await one_request(client, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    elapsed = time.perf_counter() - start
    ttft = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {
        "requests_per_s": len(prompts) / elapsed,
        "tokens_per_s": len(prompts) * max_tokens / elapsed,
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
        "itl_p50_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
        "itl_p99_ms": percentile(gaps, 0.99) * 1e3 if gaps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model folder or GGUF file (default: the embedded model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    overrides = {"engine.device": args.device, "engine.enable_prefix_caching": False}
    engine = Engine(resolve_config(None, args.model, overrides), lambda _: None)
    vocab = engine.capabilities.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)
    ]
    async_engine = AsyncEngine(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, "bench"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    asyncio.run(load(url, prompts[:4], args.max_tokens, 4))  # warm-up
    rows = [
        (c, asyncio.run(load(url, prompts, args.max_tokens, c)))
        for c in map(int, args.concurrency.split(","))
    ]
    server.should_exit = True
    thread.join(30)
    async_engine.shutdown()

    offline = LLM(args.model, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    offline.generate(prompts[:4], params)  # warm-up
    start = time.perf_counter()
    offline.generate(prompts, params)
    offline_tokens_per_s = len(prompts) * args.max_tokens / (time.perf_counter() - start)

    print(
        f"model {engine.model_dir}, device {args.device}, {args.requests} requests of {args.prompt_len} "
        f"prompt + {args.max_tokens} new tokens (greedy, streamed)"
    )
    print(
        "baseline: offline LLM.generate of the same requests, all at once: "
        f"{offline_tokens_per_s:.1f} tokens/s"
    )
    print("| concurrency | requests/s | tokens/s | x offline | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for c, r in rows:
        print(
            f"| {c} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / offline_tokens_per_s:.2f} | "
            f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
