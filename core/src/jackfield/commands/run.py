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


# Flags that override one config key (the TOML's dotted name); --set reaches every other key.
CONFIG_FLAGS = (
    ("--attention-backend", "attention.backend", str),
    ("--kv-cache-dtype", "attention.kv_cache_dtype", str),
    ("--dtype", "model.dtype", str),
    ("--device", "engine.device", str),
    ("--max-model-len", "engine.max_model_len", int),
    ("--speculative-method", "speculative.method", str),
    ("--num-speculative-tokens", "speculative.num_speculative_tokens", int),
    ("--speculative-model", "speculative.model", str),
)
# Sampling flags: SamplingParams' own defaults, so the CLI and the Python API agree.
SAMPLING_FLAGS = (("--temperature", float), ("--top-p", float), ("--top-k", int), ("--min-p", float),
                  ("--max-tokens", int), ("--logprobs", int), ("--seed", int), ("--n", int),
                  ("--presence-penalty", float), ("--frequency-penalty", float),
                  ("--repetition-penalty", float))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from jackfield.contracts.sampler import SamplingParams

    parser = subparsers.add_parser("run", help="generate text (the embedded tiny model by default)",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="a jackfield TOML file (default: built-in defaults)")
    parser.add_argument("--model", help="a local Hugging Face model directory (overrides [model].path)")
    parser.add_argument("--task", choices=("generate", "embed"), default="generate",
                        help="embed: print one pooled vector per prompt (bidirectional embedding models)")
    parser.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    parser.add_argument("--chat", action="store_true",
                        help="each --prompt is a user's message, rendered by the model's chat template "
                             "(an instruct model answers; as LLM.chat)")
    parser.add_argument("--prompt-token-ids", action="append", metavar="IDS",
                        help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    defaults = SamplingParams()
    for flag, kind in SAMPLING_FLAGS:
        name = flag[2:].replace("-", "_")
        note = " (none: drawn per request)" if name == "seed" else ""
        parser.add_argument(flag, type=kind, default=getattr(defaults, name),
                            help=f"SamplingParams.{name}{note}")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="SamplingParams.stop: text that ends the output (repeatable)")
    add_config_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode disaggregation: prefill in a second process, its KV handed "
                             "to this one through the pd KV connector (jackfield-kv-offload)")
    parser.set_defaults(handler=main)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The config flags and --set, read back by `config_overrides` (run and bench share them)."""
    for flag, key, kind in CONFIG_FLAGS:
        parser.add_argument(flag, type=kind, help=f"overrides {key}")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key; VALUE is read as TOML (a bare word is a string)")


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The dotted config overrides of --set and the config flags (flags win over --set)."""
    from jackfield.config import tomllib  # the standard library's, or tomli before Python 3.11

    overrides: dict[str, object] = {}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare word: a string
        overrides[key.strip()] = value
    for flag, key, _ in CONFIG_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides[key] = value
    return overrides


def _token_id_prompts(items: list[str] | None) -> list[list[int]]:
    prompts = []
    for item in items or []:
        try:
            prompts.append([int(t) for t in item.split(",") if t.strip()])
        except ValueError:
            raise ValueError(f"--prompt-token-ids {item!r}: expected comma-separated integers") from None
    return prompts


def _stage_bar() -> tuple[Callable[[str], None], Callable[[], None]]:
    """A stderr bar for the setup stages (shown only when setup takes over a second)."""
    bar = tqdm(total=0, bar_format="{desc} [{elapsed}]", file=sys.stderr, delay=1.0, leave=False)
    return bar.set_description_str, bar.close


def main(args: argparse.Namespace) -> int:
    from jackfield.commands.pd import PDLLM
    from jackfield.contracts.sampler import SamplingParams
    from jackfield.engine.llm import LLM
    from jackfield.engine.sequence import SpeculativeStats

    # before loading the model
    params = SamplingParams(**{flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                               for flag, _ in SAMPLING_FLAGS}, stop=tuple(args.stop))
    overrides = config_overrides(args)
    token_prompts = _token_id_prompts(args.prompt_token_ids)
    if args.chat and (token_prompts or not args.prompt or args.task == "embed"):
        raise ValueError("--chat renders --prompt texts as chat messages: give --prompt, "
                         "without --prompt-token-ids or --task embed")
    say, close = _stage_bar()
    try:  # --pd: the prefill process is stopped at exit
        llm = (PDLLM if args.pd else LLM)(args.model, args.config, progress=say, **overrides)
    finally:
        close()
    prompts: list[str | list[int]] = [*(args.prompt or []), *token_prompts] or list(DEFAULT_PROMPTS)
    if args.task == "embed":
        return _embed(llm, prompts, args.json)
    inputs = prompts
    if args.chat:  # each text a one-turn conversation; the texts themselves are printed
        from jackfield.engine.tokenizer import chat_prompt_ids

        inputs = [chat_prompt_ids(llm.tokenizer, llm.engine.model_dir, [{"role": "user", "content": p}])
                  for p in prompts]
    bar = tqdm(total=len(prompts), desc="generating", unit="req", file=sys.stderr, delay=1.0, leave=False)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False,
                           progress=lambda done, _: done > bar.n and bar.update(done - bar.n))
    elapsed = time.perf_counter() - start
    bar.close()
    engine = llm.engine
    backends = {role: {"name": c.name, "reason": c.reason} for role, c in llm.engine.backend_choices.items()}
    samples = [(p, c) for p, o in zip(prompts, outputs, strict=True) for c in o.outputs]
    generated = sum(len(c.token_ids) for _, c in samples)
    first = min(o.timings.time_to_first_token_s for o in outputs)
    decode_time = elapsed - first
    summary = {
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "time_to_first_token_s": round(first, 4),
        "decode_tokens_per_s": (round((generated - len(samples)) / decode_time, 1)
                                if decode_time > 0 else None),
        "total_s": round(elapsed, 4),
    }
    if engine.drafter is not None:  # drafts and acceptance over the run
        run_stats = SpeculativeStats()
        for _, sample in samples:
            assert sample.speculative is not None
            run_stats.add(sample.speculative)
        summary["speculative"] = {"method": engine.drafter.name, **run_stats.as_dict()}
    connector_stats = engine.kv_connector_stats()
    if connector_stats is not None:  # e.g. prefix hits served from the CPU tier (hit_tokens)
        summary["kv_connector"] = connector_stats
    if isinstance(llm, PDLLM):  # the prefill engine's side of the handoff
        summary["pd_prefill"] = {"kv_connector": llm.producer_stats(), "error": llm.producer_error}
    threads = engine.runner.cpu_threads  # None off the CPU
    if args.json:
        results = [  # one entry per sample (index: which of the prompt's n)
            {"prompt": p if isinstance(p, str) else None, "index": c.index, "text": c.text,
             "token_ids": c.token_ids, "finish_reason": c.finish_reason, "seed": c.seed}
            for p, c in samples
        ]
        print(json.dumps({"model": str(engine.model_dir), "device": str(engine.device),
                          "dtype": str(engine.capabilities.dtype), "backends": backends,
                          "kv_cache": engine.kv_cache_summary(),
                          "cuda_graphs_off_reason": engine.runner.decode_graphs_off,
                          "prefill_graphs_off_reason": engine.runner.prefill_graphs_off,
                          "cpu_threads": threads and threads.summary(),
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
    print(kv_cache_line(engine.kv_cache_summary()))
    if threads is not None:
        print(cpu_threads_line(threads.summary()))
    for prompt, out in samples:
        print(f"\n--- {prompt!r}{f' [{out.index}]' if params.n > 1 else ''} ({out.finish_reason})")
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
    if "kv_connector" in summary:
        print("kv connector: " + ", ".join(f"{k} {v}" for k, v in summary["kv_connector"].items()))
    if "pd_prefill" in summary:
        prefill = summary["pd_prefill"]
        stats = prefill["kv_connector"] or {}
        print("prefill engine: " + (", ".join(f"{k} {v}" for k, v in stats.items()) or "no report")
              + (f" (stopped: {prefill['error']})" if prefill["error"] else ""))
    return 0


def cpu_threads_line(summary: dict[str, object]) -> str:
    """`CpuThreads.summary()` in one line: the count, and the decode step times it was chosen by."""
    times = summary["decode_step_ms"]
    assert isinstance(times, dict)
    measured = ", ".join(f"{ms} ms at {count}" for count, ms in times.items())
    how = f"{summary['source']}: decode step {measured}" if measured else summary["source"]
    return f"cpu threads: {summary['threads']} ({how})"


def kv_cache_line(summary: dict[str, object]) -> str:
    """`Engine.kv_cache_summary()` in one line: the dtype, and an fp8 cache's scales (where they
    come from, their range over the layers)."""
    line = f"kv cache: {summary['dtype']}"
    if "scale_source" not in summary:
        return line
    line += f", scales ({summary['scale_source']}): {summary['scale_detail']}"
    scales = summary["scales"]
    if scales is None:
        return line + ", not calibrated yet (no prefill ran)"
    assert isinstance(scales, list)
    parts = list(zip(*scales, strict=True))  # per part of a layer's scales, over the layers
    names = ("record",) if len(parts) == 1 else ("keys", "values")
    ranges = ", ".join(f"{name} {min(values):.4g}..{max(values):.4g}"
                       for name, values in zip(names, parts, strict=True))
    return f"{line}; {len(scales)} layers, {ranges}"


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
