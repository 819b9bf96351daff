"""The host cost of EAGLE-3 drafting (issue 18): a random Llama target and a random EAGLE-3 head
(SmolLM2-135M's shapes by default), no checkpoint download. Per batch size, the median of an
engine step without drafts, of an eagle3 step, and of the eagle3 step's drafting phase alone (the
model runner's `_draft`: the head over the verified rows and the chain of drafts, between device
syncs), all greedy with `ignore_eos`. A random head's drafts are rarely accepted: the figures
are per step, not tokens/s. The ceiling, measured in the same run: the copy bandwidth, and with
it the drafting phase's floor, k reads of the head's weights (each draft's forward reads them
once). With CUDA graphs a plain greedy step's drafting replays right behind its verify and comes
back with its tokens (`DraftGraphs.run_greedy`), so `_draft` is left only the drafts' sorting on
the host: there the `_draft` column is that remainder, and the eagle3 step's extra time over a
plain one, against the floor, is the drafting's cost. On CUDA, a further run counts each eagle3
decode step's host syncs (with graphs: its one read-back).

  python benchmarks/bench_eagle3_drafting.py                      # CUDA when present (graphs on)
  python benchmarks/bench_eagle3_drafting.py --device cpu --profile 1   # cProfile of batch 1's drafting
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from bench_e2e import ceilings
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import write_granite
from jackfield_spec_decode.testing import write_eagle3


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def counting_syncs(syncs: list[int], run: Callable[[], None]) -> None:
    """Runs `run` and appends its host syncs, as CUDA's sync debug mode counts them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs.append(sum("synchroniz" in str(w.message) for w in caught))


def timed_phase(llm: LLM, batch: list[list[int]], params: SamplingParams, device: str,
                profile: cProfile.Profile | None = None, syncs: list[int] | None = None,
                ) -> tuple[list[float], list[float]]:
    """(seconds of each decode step, seconds of each step's drafting phase), each between syncs.
    `syncs` (CUDA): gets the host syncs of each decode step (each step then runs with the
    warnings on)."""
    runner, engine = llm.engine.runner, llm.engine
    inner = runner._draft
    drafting: list[float] = []

    def timed(*args: object) -> object:
        sync(device)
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        out = inner(*args)
        sync(device)
        if profile is not None:
            profile.disable()
        drafting.append(time.perf_counter() - start)
        return out

    if runner.drafter is not None and syncs is None:  # counted steps keep the timer's syncs out
        runner._draft = timed
    steps: list[float] = []
    try:
        seqs = engine.add_requests([(p, params) for p in batch])
        while engine.scheduler.has_work():
            prefilling = any(s.num_computed < s.prompt_len for s in seqs)
            sync(device)
            start = time.perf_counter()
            if syncs is not None and not prefilling:
                counting_syncs(syncs, engine.step)
            else:
                engine.step()
            sync(device)
            if not prefilling:
                steps.append(time.perf_counter() - start)
    finally:
        if runner.drafter is not None and syncs is None:
            del runner._draft  # the method again
    return steps, drafting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30, help="the target's layers (SmolLM2-135M: 30)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--draft-vocab", type=int,
                        help="the head's vocabulary (default: the target's, as train_eagle3 writes it)")
    parser.add_argument("--profile", type=int, metavar="BATCH",
                        help="cProfile the drafting at this batch size")
    args = parser.parse_args()
    args.draft_vocab = args.draft_vocab or args.vocab
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        target, head = Path(tmp) / "target", Path(tmp) / "head"
        write_granite("llama", target, vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=2048)
        taps = None if args.layers >= 8 else [0, 1, args.layers - 1]  # the default needs 8 layers
        write_eagle3(head, target, 0, taps=taps, draft_vocab=args.draft_vocab, heads=9, kv_heads=3,
                     head_dim=args.hidden // 9, intermediate=4 * args.hidden, max_position_embeddings=2048)
        base: dict[str, object] = {"engine.device": args.device, "engine.enable_prefix_caching": False,
                                   "model.dtype": str(dtype).removeprefix("torch.")}
        if args.device == "cuda":  # two engines share the device (as train_eagle3's)
            base["engine.gpu_memory_fraction"] = 0.2
        spec = {"speculative.method": "eagle3", "speculative.num_speculative_tokens": args.k,
                "speculative.model": str(head)}
        plain, eagle = LLM(str(target), **base), LLM(str(target), **base, **spec)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        head_module = eagle.engine.runner.drafter.head  # type: ignore[union-attr]
        head_bytes = sum(p.numel() * p.element_size() for p in head_module.parameters())
        _, bandwidth = ceilings(args.device, dtype)
        floor_ms = 1e3 * args.k * head_bytes / bandwidth
        print(f"device {args.device}, target {args.layers} layers x {args.hidden}, vocab {args.vocab}, "
              f"draft vocab {args.draft_vocab}, k {args.k}, {args.new_tokens} new tokens")
        print(f"ceiling: copy {bandwidth / 1e9:.0f} GB/s; the head's weights {head_bytes / 2**20:.1f} MiB, "
              f"so a drafting phase's floor (k reads) {floor_ms:.3f} ms")
        print("| batch | plain step ms | eagle3 step ms | eagle3 / plain | (eagle3 - plain) / floor "
              "| `_draft` ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for batch_size in args.batch_sizes:
            batch = [torch.randint(0, args.vocab, (32,), generator=g).tolist() for _ in range(batch_size)]
            median: Callable[[list[float]], float] = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
            timed_phase(plain, batch, params, args.device)  # warm-up
            timed_phase(eagle, batch, params, args.device)
            plain_steps, _ = timed_phase(plain, batch, params, args.device)
            eagle_steps, drafting = timed_phase(eagle, batch, params, args.device)
            plain_ms, eagle_ms = median(plain_steps), median(eagle_steps)
            print(f"| {batch_size} | {plain_ms:.2f} | {eagle_ms:.2f} | {eagle_ms / plain_ms:.2f}x | "
                  f"{(eagle_ms - plain_ms) / floor_ms:.0f}x | {median(drafting):.2f} |", flush=True)
            if args.device == "cuda":
                syncs: list[int] = []
                timed_phase(eagle, batch, params, args.device, syncs=syncs)
                print(f"host syncs per eagle3 decode step at batch {batch_size} (CUDA sync debug mode): "
                      f"min {min(syncs)}, max {max(syncs)}, over {len(syncs)} steps", flush=True)
            if batch_size == args.profile:  # a run of its own: the profiler slows what it sees
                profile = cProfile.Profile()
                _, phases = timed_phase(eagle, batch, params, args.device, profile)
                print(f"cProfile of {len(phases)} drafting phases at batch {batch_size}:")
                pstats.Stats(profile).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
