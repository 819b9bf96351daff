"""Host time of a decode step, phase by phase (issue 19: count first).

The engine runs a tiny model (the Llama and Granite SWA layouts of bench_e2e, shrunk so the
forward is cheap) over a batch of requests that all decode, and times each step's phases with
perf_counter around the engine's own methods:

- schedule: `Scheduler.schedule` (trim, grow, the chunks);
- fill: the step's inputs: the eager metadata and staging (`ModelRunner.forward` less the model
  and the plan), or the CUDA-graph buffer fill (`DecodeGraphs._fill`);
- plan: the attention backends' metadata builders (`StepContextBuilder.build`; a graph replay
  reuses the metadata built at capture);
- forward: the model's layers (eager), or the graph replay and, on CUDA, the wait for it (the
  probe synchronizes after the replay, so the other phases are host work only);
- sample: logits, sampling and the token read-back (the rest of `ModelRunner.step`);
- update: the engine's bookkeeping after the step (`Engine.step` less the rest).

Without CUDA graphs (the CPU) it also times the graph fill a CUDA step does, over the same
chunks and static host buffers ("graph fill"). On CUDA it also times the forward's GPU time by
replaying the step's graph alone between events ("GPU fwd"). Medians over the timed steps, in
microseconds a step, with each phase's ratio to the forward; "host" is the sum of the medians
of every phase but the forward (on a busy host a step's sum catches the odd preemption).
`--statistic min` takes each phase's minimum instead: on a shared machine whose other jobs
preempt most steps somewhere, the least time a phase took is what its code costs.

--host-only replaces the model's forward by zeros of its output's shape (the CPU): every step is
then host work, which keeps a shared machine's preemptions, landing mostly in a long forward,
out of the figures.

  python benchmarks/bench_host.py                                   # CPU: llama, granite-swa; batch 64, 128
  python benchmarks/bench_host.py --device cuda --batches 64
  python benchmarks/bench_host.py --host-only                       # CPU: host work only
  python benchmarks/bench_host.py --profile                         # also cProfile's top functions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from jackfield.engine.engine import Engine

# head size 64 as the 1B shape's (and one cuda_attn serves, so the CUDA run replays graphs)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=500000.0,
            tie_word_embeddings=True)
WINDOW = 128  # bench_e2e's SWA window
PHASES = ("schedule", "fill", "plan", "forward", "sample", "update")


def tiny_model(family: str, max_len: int) -> str:
    """A random tiny checkpoint of `family` in a temporary folder."""
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, max_position_embeddings=max_len))
    else:  # every fourth layer full, the rest windowed: two KV cache groups
        hf = transformers.GraniteSWAForCausalLM(
            transformers.GraniteSWAConfig(**TINY, max_position_embeddings=max_len, sliding_window=WINDOW))
    directory = tempfile.mkdtemp(prefix="bench_host.")
    hf.save_pretrained(directory)
    return directory


def forward_of_zeros(engine: Engine) -> None:
    """Replace the model's forward by zeros of its hidden size: what remains of a step is host work."""
    hidden_size = engine.model.capabilities.hidden_size

    def zeros(ids: torch.Tensor, positions: torch.Tensor, context: object,
              rows: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        return torch.zeros(ids.shape[0] if rows is None else rows.shape[0], hidden_size)

    engine.model.forward = zeros  # type: ignore[method-assign]


class PhaseClock:
    """Seconds spent inside wrapped methods, per label, since the last `lap`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[label] += time.perf_counter() - start

        setattr(owner, name, timed)  # on the instance: the class keeps its own

    def lap(self) -> dict[str, float]:
        """The times since the last lap (0 for a label nothing ran under)."""
        spent, self.spent = self.spent, defaultdict(float)
        return spent


def phases_of(spent: dict[str, float], graphs: bool) -> dict[str, float]:
    """The step's phases from the wrapped methods' times (nested ones subtracted; the CPU probe's
    graph fill runs inside the engine's step, outside every phase)."""
    plan = spent["plan"]
    if graphs:
        fill, forward = spent["graph_fill"], spent["graph_run"] - spent["graph_fill"]
    else:
        fill, forward = spent["runner_forward"] - spent["model"] - plan, spent["model"]
    return dict(schedule=spent["schedule"], fill=fill, plan=plan, forward=forward,
                sample=spent["runner_step"] - fill - plan - forward,
                update=spent["step"] - spent["schedule"] - spent["runner_step"] - spent["shadow_fill"])


def probe(family: str, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """Median microseconds a decode step per phase (and the extra columns), for one configuration."""
    from jackfield import LLM, SamplingParams
    from jackfield.engine.cuda_graphs import DecodeGraphs

    steps = args.warm_steps + args.steps
    budget = 2048  # engine.max_num_batched_tokens: the prompts take several prefill steps
    # the first admitted requests decode while the last prefill: nobody may finish before the end
    max_tokens = steps + -(-batch * args.prompt_len // budget) + 4
    max_len = args.prompt_len + max_tokens
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    llm = LLM(tiny_model(family, max_len), **{
        "attention.backend": args.backend, "engine.device": args.device, "model.dtype": dtype,
        "engine.block_size": args.block_size, "engine.max_num_seqs": batch,
        "engine.max_num_batched_tokens": budget, "engine.max_model_len": max_len,
        "engine.enable_prefix_caching": args.prefix_caching, "engine.cpu_kv_cache_gib": 1.0,
        # phases of the synchronous step: a pipelined step's host work overlaps the device's
        "engine.async_scheduling": False,
    })
    engine, runner = llm.engine, llm.engine.runner
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, TINY["vocab_size"], (batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = engine.add_requests([(p, params) for p in prompts])
    while any(s.num_computed < s.prompt_len for s in seqs):  # prefill, chunked by the budget
        engine.step()
    if args.host_only:
        forward_of_zeros(engine)
    clock = PhaseClock()
    clock.wrap(engine, "step", "step")
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(runner, "step", "runner_step")
    clock.wrap(runner, "forward", "runner_forward")
    clock.wrap(engine.model, "forward", "model")
    clock.wrap(runner.contexts, "build", "plan")
    graphs = runner.graphs
    if graphs is not None:
        clock.wrap(graphs, "_fill", "graph_fill")
        replay = graphs.run

        def replay_and_wait(*args: object, **kwargs: object) -> torch.Tensor:
            hidden = replay(*args, **kwargs)
            torch.cuda.synchronize()
            return hidden

        graphs.run = replay_and_wait  # type: ignore[method-assign]
        clock.wrap(graphs, "run", "graph_run")
        shadow = None
    else:  # the graph fill a CUDA step would do, on static host buffers over the same chunks
        shadow = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                              runner.block_tables, runner.kv.num_blocks, runner.block_size,
                              engine.max_model_len, batch, runner.device)
        scheduled = engine.scheduler.schedule

        def schedule_and_fill() -> list:
            chunks = scheduled()
            start = time.perf_counter()
            shadow._fill(chunks, next(s for s in shadow.sizes if s >= len(chunks)), 1)
            clock.spent["shadow_fill"] += time.perf_counter() - start
            return chunks

        engine.scheduler.schedule = schedule_and_fill
    profiler = cProfile.Profile() if args.profile else None
    laps = []
    for i in range(steps):
        if profiler is not None and i == args.warm_steps:
            profiler.enable()
        engine.step()
        laps.append(clock.lap())
    if profiler is not None:
        profiler.disable()
        print(f"\n{family} batch {batch}: cProfile over {args.steps} decode steps")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_rows)
    timed = laps[args.warm_steps :]
    assert len(engine.scheduler.running) == batch and all(s.num_computed == s.num_tokens - 1 for s in seqs), \
        "every request decodes throughout"
    per_step = [phases_of(lap, graphs is not None) for lap in timed]
    stat = statistics.median if args.statistic == "median" else min
    row = {phase: stat(p[phase] for p in per_step) * 1e6 for phase in PHASES}
    row["step"] = stat(lap["step"] for lap in timed) * 1e6
    row["host"] = sum(row[phase] for phase in PHASES if phase != "forward")
    if shadow is not None:
        row["graph fill"] = stat(lap["shadow_fill"] for lap in timed) * 1e6
    else:
        row["GPU fwd"] = gpu_forward_us(graphs, batch)
    row["groups"] = len(runner.groups.windows)
    row["backend"] = engine.backend_choices["decode"].name  # type: ignore[assignment]
    return row


def gpu_forward_us(graphs: object, batch: int) -> float:
    """GPU time of one replay of the batch's decode graph (its buffers hold the last step)."""
    size = next(s for s in graphs.sizes if s >= batch)  # type: ignore[attr-defined]
    graph = graphs.graphs[size, 1][0]  # type: ignore[attr-defined]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--families", default="llama,granite-swa")
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64, help="the H200 backends' pick")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps")
    parser.add_argument("--warm-steps", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--prefix-caching", action="store_true", help="bench_e2e runs without it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the engine's host work runs on one)")
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="of each phase over the timed steps (module docstring)")
    parser.add_argument("--host-only", action="store_true", help="a forward of zeros (module docstring)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions per run")
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"seed {args.seed}, device {args.device}, prompt {args.prompt_len}, block {args.block_size}, "
          f"{args.steps} timed decode steps after {args.warm_steps}, torch threads {torch.get_num_threads()}")
    rows = [(family, batch, probe(family, batch, args))
            for family in args.families.split(",") for batch in (int(b) for b in args.batches.split(","))]
    extra = "GPU fwd" if args.device == "cuda" else "graph fill"
    ratio = "" if args.host_only else ", and x the forward"
    print(f"\nmicroseconds a decode step ({args.statistic}){ratio}; '{extra}': "
          + ("the replay's GPU time" if extra == "GPU fwd" else "the CUDA path's buffer fill, on the host"))
    print(f"| family | batch | backend | KV groups | step | {' | '.join(PHASES)} | host "
          f"| {extra} |")
    print("|---|---|---|---|---|" + "---|" * (len(PHASES) + 2))
    for family, batch, row in rows:
        cells = [f"{row[p]:.0f}" if args.host_only else f"{row[p]:.0f} ({row[p] / row['forward']:.2f}x)"
                 for p in (*PHASES, "host")]
        print(f"| {family} | {batch} | {row['backend']} | {row['groups']} | {row['step']:.0f} | "
              f"{' | '.join(cells)} | {row[extra]:.0f} |")


if __name__ == "__main__":
    main()
