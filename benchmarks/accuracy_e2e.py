"""Accuracy study: Jackfield in bf16 against transformers in float32 on the bench's MID model,
beside transformers' own bf16 error, with one kernel choice varied at a time.

Both transformers models are loaded from the checkpoint with from_pretrained: float32 is the
reference, bf16 is transformers as a user runs it (RoPE frequencies in float32 in both; the
random model is built in float32 and saved in bf16). Per position, the figure is the max
|logprob difference| over an engine's own top-5 tokens against the reference. Two statistics:
  first token: at each prompt's last position (bench_e2e's agreement), median and max over the
    prompts. A random bf16 MoE model has routing knife-edges (a rounding flips an expert
    choice: errors of ~0.3-2 on a few prompts), so 8 prompts give a noisy median.
  every position: at each of the prompts' positions (the engine's prompt_logprobs), median and
    mean over them: 512x the samples of the first-token figure.
--dense replaces every MoE layer with a dense MLP to take the flips out. --per-layer adds, for
the default variant, the error of the residual stream at each layer's input, of the attention
output (o_proj's input) and of the MLP output, against the reference's, over every token and
over the prompts' last tokens. Findings: benchmarks/notes_accuracy.md.
The variants: the expanded prefill's SDPA in float32 (the CPU's default: a 16-bit fused kernel
rounds the softmax probabilities before their product with v), the shared prefill's SDPA backend
(cuDNN is PyTorch's first choice on Hopper) and the routed experts' grouped matmul (transformers
loops over experts).

    python3 benchmarks/accuracy_e2e.py [--prompts 8] [--prompt-len 512] [--device cuda] [--dense]
        [--per-layer]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_e2e import MID, transformers_logprobs
from torch import nn


@dataclass(frozen=True)
class Errors:
    """Max |logprob difference| over a run's top-5 tokens at every position [prompts, positions]."""

    every: torch.Tensor

    def row(self, label: str) -> str:
        first = self.every[:, -1].tolist()
        return (f"| {label} | {statistics.median(first):.4f} | {max(first):.4f} | "
                f"{self.every.median().item():.4f} | {self.every.mean().item():.4f} |")


def jackfield_errors(llm, prompts: torch.Tensor, want: torch.Tensor) -> Errors:  # type: ignore[no-untyped-def]
    from jackfield import SamplingParams
    from jackfield.testing.accuracy import engine_errors

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, prompt_logprobs=5)
    return Errors(engine_errors(llm.generate([p.tolist() for p in prompts], params), want))


def tap(model: nn.Module, taps: dict[str, list[torch.Tensor]]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks keeping, per layer i, the residual stream into it (`input{i}`), the attention output
    (`attention{i}`, o_proj's input) and the MLP output (`mlp{i}`), and the final norm's input.
    Jackfield's DeepSeek model names these modules as transformers does."""

    def keep(name: str, output: bool = False) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor | None = None) -> None:
            x = out if output else args[0]
            taps.setdefault(name, []).append(x.detach().reshape(-1, x.shape[-1]).clone())

        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.input_layernorm.register_forward_pre_hook(keep(f"input{i}")))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(keep(f"attention{i}")))
        handles.append(layer.mlp.register_forward_hook(keep(f"mlp{i}", output=True)))
    handles.append(model.model.norm.register_forward_pre_hook(keep("final")))
    return handles


def print_per_layer(taps: dict[str, dict[str, list[torch.Tensor]]], num_layers: int, prompt_len: int) -> None:
    """Mean relative error (per token, ||x - ref|| / ||ref||) of Jackfield's and transformers
    bf16's taps against the reference's, over every token and over the prompts' last tokens."""
    got = {run: {name: torch.cat(parts) for name, parts in kept.items()} for run, kept in taps.items()}
    if not torch.equal(got["jackfield"]["input0"].cpu(), got["transformers bf16"]["input0"].cpu()):
        raise RuntimeError("the engine's rows are not the prompts' tokens in order: no per-layer comparison")
    names = [f"{point}{i}" for i in range(num_layers) for point in ("input", "attention", "mlp")] + ["final"]
    print("| tap | Jackfield, every token | transformers bf16, every token | Jackfield, last tokens | "
          "transformers bf16, last tokens |")
    print("|---|---|---|---|---|")
    for name in names:
        want = got["reference"][name].double()
        errors = {run: ((got[run][name].double() - want).norm(dim=-1) / want.norm(dim=-1)).cpu()
                  for run in ("jackfield", "transformers bf16")}
        cells = [e.mean().item() for e in errors.values()]
        cells += [e[prompt_len - 1 :: prompt_len].mean().item() for e in errors.values()]
        print(f"| {name} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")


def _float32(q: torch.Tensor) -> torch.dtype:
    return torch.float32


def _own(q: torch.Tensor) -> torch.dtype:
    return q.dtype


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--dense", action="store_true", help="every layer a dense MLP (no routing flips)")
    parser.add_argument("--per-layer", action="store_true", help="per-layer errors of the default variant")
    args = parser.parse_args()
    import jackfield.attention.mla as mla
    import jackfield.models.moe as moe
    from jackfield import LLM
    from jackfield.testing.accuracy import own_top5_errors
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    dense = dict(MID, first_k_dense_replace=MID["num_hidden_layers"])
    config = DeepseekV3Config(**(dense if args.dense else MID))
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=gen)
    grouped, attention_dtype = moe.use_grouped_mm, mla.prefill_attention_dtype
    # (label, SDPA without cuDNN, experts as grouped matmuls, prefill attention dtype)
    variants: list[tuple[str, bool, bool, Callable[[torch.Tensor], torch.dtype]]] = [
        ("default", False, True, attention_dtype)
    ]
    if args.device == "cuda":
        variants += [
            ("float32 prefill attention", False, True, _float32),
            ("looped experts", False, False, _own),
            ("no cuDNN SDPA", True, True, _own),
            ("no cuDNN SDPA, looped experts", True, False, _own),
        ]
    else:
        variants += [("bf16 prefill attention (before 2026-11-29)", False, True, _own)]
    taps: dict[str, dict[str, list[torch.Tensor]]] = {run: {} for run in ("reference", "transformers bf16",
                                                                          "jackfield")}

    def keep(run: str) -> Callable[[nn.Module], object] | None:
        return (lambda model: tap(model, taps[run])) if args.per_layer else None

    with tempfile.TemporaryDirectory(prefix="accuracy_e2e.") as directory:
        with torch.device(args.device):
            DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
        want = transformers_logprobs(directory, prompts, args.device, torch.float32, True, keep("reference"))
        theirs = {"transformers bf16": Errors(own_top5_errors(transformers_logprobs(
            directory, prompts, args.device, torch.bfloat16, True, keep("transformers bf16")), want))}
        if args.device == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)
            theirs["transformers bf16, no cuDNN SDPA"] = Errors(own_top5_errors(
                transformers_logprobs(directory, prompts, args.device, torch.bfloat16, True), want))
            torch.backends.cuda.enable_cudnn_sdp(True)
        # No CUDA graphs: the variants swap functions the graphs would have recorded once (the
        # default's figures are the same with and without graphs: notes_accuracy.md, GPU).
        llm = LLM(
            directory,
            **{
                "engine.device": args.device,
                "model.dtype": "bfloat16",
                "engine.max_num_batched_tokens": args.prompts * args.prompt_len,
                "engine.enable_prefix_caching": False,
                "engine.cpu_kv_cache_gib": 2,
                "engine.cuda_graphs": False,
            },
        )
        print("Max |logprob diff| over each run's top-5 tokens vs transformers float32 "
              f"({args.prompts} prompts x {args.prompt_len}, {args.device}):")
        print("| run | first token median | first token max | every position median | "
              "every position mean |")
        print("|---|---|---|---|---|")
        for label, errors in theirs.items():
            print(errors.row(label), flush=True)
        for label, no_cudnn, use_grouped, dtype in variants:
            moe.use_grouped_mm = grouped if use_grouped else (lambda rows: False)
            mla.prefill_attention_dtype = dtype
            if args.device == "cuda":
                torch.backends.cuda.enable_cudnn_sdp(not no_cudnn)
            per_layer = args.per_layer and label == "default"
            handles = tap(llm.engine.model, taps["jackfield"]) if per_layer else []
            print(jackfield_errors(llm, prompts, want).row(f"Jackfield: {label}"), flush=True)
            for handle in handles:
                handle.remove()
    moe.use_grouped_mm, mla.prefill_attention_dtype = grouped, attention_dtype
    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    if args.per_layer:
        print_per_layer(taps, config.num_hidden_layers, args.prompt_len)


if __name__ == "__main__":
    main()
