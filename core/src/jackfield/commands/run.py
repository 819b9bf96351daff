"""`jackfield run`: generate for each --prompt and print the backends chosen, the texts and a summary.

Progress bars (model creation, loading, generation) go to stderr; --json prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from jackfield.engine.llm import LLM

DEFAULT_PROMPTS = ("The quick brown fox", "Jackfield is")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="generate text (the embedded tiny model by default)")
    parser.add_argument("--config", help="a jackfield TOML file (default: built-in defaults)")
    parser.add_argument("--model", help="a local Hugging Face model directory (overrides [model].path)")
    parser.add_argument("--task", choices=("generate", "embed"), default="generate",
                        help="embed: print one pooled vector per prompt (bidirectional embedding models)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int,
                        help="sampling seed for every prompt (default: drawn per request)")
    parser.add_argument("--attention-backend", help="overrides [attention].backend")
    parser.add_argument("--speculative-method", help="a drafter (overrides [speculative].method), e.g. ngram")
    parser.add_argument("--num-speculative-tokens", type=int,
                        help="tokens drafted per step (overrides [speculative].num_speculative_tokens)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(handler=main)


def _stage_bar() -> tuple[Callable[[str], None], Callable[[], None]]:
    """A stderr bar for the setup stages (shown only when setup takes over a second)."""
    bar = tqdm(total=0, bar_format="{desc} [{elapsed}]", file=sys.stderr, delay=1.0, leave=False)
    return bar.set_description_str, bar.close


def main(args: argparse.Namespace) -> int:
    from jackfield.contracts.sampler import SamplingParams
    from jackfield.engine.llm import LLM
    from jackfield.engine.sequence import SpeculativeStats

    # before loading the model
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    overrides: dict[str, object] = {}
    for key, value in (("attention.backend", args.attention_backend),
                       ("speculative.method", args.speculative_method),
                       ("speculative.num_speculative_tokens", args.num_speculative_tokens)):
        if value is not None:
            overrides[key] = value
    say, close = _stage_bar()
    try:
        llm = LLM(args.model, args.config, progress=say, **overrides)
    finally:
        close()
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    if args.task == "embed":
        return _embed(llm, prompts, args.json)
    bar = tqdm(total=len(prompts), desc="generating", unit="req", file=sys.stderr, delay=1.0, leave=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params,
                           progress=lambda done, _: done > bar.n and bar.update(done - bar.n))
    elapsed = time.perf_counter() - start
    bar.close()
    engine = llm.engine
    backends = {role: {"name": c.name, "reason": c.reason} for role, c in llm.engine.backend_choices.items()}
    generated = sum(len(o.token_ids) for o in outputs)
    first = min(o.timings.time_to_first_token_s for o in outputs)
    decode_time = elapsed - first
    summary = {
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "time_to_first_token_s": round(first, 4),
        "decode_tokens_per_s": (round((generated - len(outputs)) / decode_time, 1)
                                if decode_time > 0 else None),
        "total_s": round(elapsed, 4),
    }
    if engine.drafter is not None:  # drafts and acceptance over the run
        run_stats = SpeculativeStats()
        for output in outputs:
            assert output.speculative is not None
            run_stats.add(output.speculative)
        summary["speculative"] = {"method": engine.drafter.name, **run_stats.as_dict()}
    if args.json:
        results = [
            {"prompt": p if isinstance(p, str) else None, "text": o.text, "token_ids": o.token_ids,
             "finish_reason": o.finish_reason, "seed": o.seed}
            for p, o in zip(prompts, outputs, strict=True)
        ]
        print(json.dumps({"model": str(engine.model_dir), "device": str(engine.device),
                          "dtype": str(engine.capabilities.dtype), "backends": backends,
                          "cuda_graphs_off_reason": engine.runner.decode_graphs_off,
                          "prefill_graphs_off_reason": engine.runner.prefill_graphs_off,
                          "outputs": results, "summary": summary}, indent=2))
        return 0
    dtype_name = str(engine.capabilities.dtype).removeprefix("torch.")
    print(f"model: {engine.model_dir} ({engine.device}, {dtype_name})")
    for role, choice in backends.items():
        print(f"{role} attention: {choice['name']} ({choice['reason']})")
    graphs = "on" if engine.runner.decode_graphs_off is None else f"off: {engine.runner.decode_graphs_off}"
    print(f"decode CUDA graphs: {graphs}")
    pieces = "on" if engine.runner.prefill_graphs_off is None else f"off: {engine.runner.prefill_graphs_off}"
    print(f"prefill CUDA graphs (pieces between attention calls): {pieces}")
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"\n--- {prompt!r} ({out.finish_reason})")
        print(out.text if out.text is not None else out.token_ids)
    print(
        f"\nprompt tokens {summary['prompt_tokens']}, generated tokens {generated}, "
        f"time to first token {first * 1000:.1f} ms, decode {summary['decode_tokens_per_s']} tokens/s"
    )
    if "speculative" in summary:
        spec = summary["speculative"]
        print(f"speculative ({spec['method']}): {spec['drafts']} drafts, {spec['draft_tokens']} draft "
              f"tokens, {spec['accepted_tokens']} accepted (per position {spec['accepted_per_position']}), "
              f"mean acceptance length {spec['mean_acceptance_length']}")
    return 0


def _embed(llm: LLM, prompts: list[str], as_json: bool) -> int:
    engine = llm.engine
    start = time.perf_counter()
    vectors = llm.embed(prompts)
    elapsed = time.perf_counter() - start
    if as_json:
        print(json.dumps({"model": str(engine.model_dir), "pooling": engine.pooling, "dim": vectors.shape[1],
                          "embeddings": vectors.tolist(), "total_s": round(elapsed, 4)}))
        return 0
    print(f"model: {engine.model_dir} ({engine.device}), pooling {engine.pooling}, dim {vectors.shape[1]}")
    for prompt, vector in zip(prompts, vectors, strict=True):
        head = ", ".join(f"{v:.4f}" for v in vector[:6].tolist())
        print(f"{prompt!r}: [{head}, ...] norm {float(vector.norm()):.4f}")
    print(f"\n{len(prompts)} embeddings in {elapsed * 1000:.1f} ms")
    return 0
