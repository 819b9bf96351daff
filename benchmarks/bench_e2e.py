"""End-to-end generation: Jackfield vs transformers' generate on the same weights.

Models (--family): DeepSeek-V3 (MLA + MoE, random weights), Llama in the Llama-3.2-1B shape
(GQA 32/8, head 64, random weights), Granite SWA in the same shape (sliding-window layers with
sinks, every fourth layer full), the hybrids: qwen3-next (Qwen3-Next-80B's layer shapes, 8
layers, 64 experts: Gated DeltaNet with every fourth layer gated attention) and granite-hybrid
(Granite-4.0-H-Tiny's layer shapes, 8 layers: Mamba2 with every fourth layer attention, no
RoPE), or --model-dir: a real checkpoint (e.g. SmolLM2-135M-Instruct:
`python benchmarks/smollm2.py --converted` gives its folder).

Per batch size: time to first token (all requests submitted at once; Jackfield: mean over
requests) and decode tokens/s (tokens after the
first over the time after the first; transformers' times come from its streamer hook, which
generate calls with each step's tokens). For the hybrid families transformers generates 16
tokens (--hf-new-tokens), to keep the run short: its hybrid decode steps are slow (PyTorch
fallbacks where causal_conv1d or mamba_ssm are missing), and its rate over 15 steps is the same
per-step rate. Ceilings measured in the same run: the dense matmul rate and the memory copy
bandwidth; decode is compared with the bandwidth ceiling (every step reads all weights once:
ceiling tokens/s = batch * bandwidth / weight bytes). Progress lines say when each stage ended.

  python benchmarks/bench_e2e.py --device cuda                 # mid-size config, bf16
  python benchmarks/bench_e2e.py --device cpu --small          # reduced config, float32
  python benchmarks/bench_e2e.py --device cuda --family llama
  python benchmarks/bench_e2e.py --device cuda --family qwen3-next
  python benchmarks/bench_e2e.py --device cuda --family granite-hybrid
  python benchmarks/bench_e2e.py --device cpu --model-dir "$(python benchmarks/smollm2.py --converted)"

--kv-cache-dtype fp8_e4m3 times the engine with an fp8 KV cache (scales calibrated from the first
prefill) against the same engine with the model-dtype (bf16) cache, one after the other in the
same process and at the same engine.gpu_memory_fraction, instead of transformers (which could not
hold long contexts at these batches): TTFT and decode tokens/s of each, the KV capacity each
gets (tokens the same memory holds), greedy agreement of the fp8 run with the bf16 run, and
each's first-token logprob error against transformers float32. Long context, e.g.:

  python benchmarks/bench_e2e.py --kv-cache-dtype fp8_e4m3 --prompt-len 16384 --batches 32,64
  python benchmarks/bench_e2e.py --kv-cache-dtype fp8_e4m3 --family llama --prompt-len 8192 --batches 32,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

MID = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    moe_intermediate_size=1024,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    max_position_embeddings=4096,
)
SMALL = dict(
    MID,
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=8,
)

LLAMA_1B = dict(  # Llama-3.2-1B's shape
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
LLAMA_SMALL = dict(LLAMA_1B, vocab_size=8000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2)
SWA_WINDOW = 128
QWEN3_NEXT = dict(  # Qwen3-Next-80B-A3B's layer shapes, fewer layers and experts
    vocab_size=32000, hidden_size=2048, intermediate_size=5120, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=64,
    num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    max_position_embeddings=4096,
)  # fmt: skip
QWEN3_NEXT_SMALL = dict(QWEN3_NEXT, vocab_size=8000, hidden_size=512, num_hidden_layers=4, head_dim=64,
                        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
                        linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2)
GRANITE_HYBRID = dict(  # Granite-4.0-H-Tiny's layer shapes, fewer layers
    vocab_size=32000, hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024,
    num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, num_local_experts=64,
    num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
    mamba_d_conv=4, mamba_expand=2, position_embedding_type=None, max_position_embeddings=4096,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
)  # fmt: skip
HYBRIDS = ("qwen3-next", "granite-hybrid")
GRANITE_HYBRID_SMALL = dict(GRANITE_HYBRID, vocab_size=8000, hidden_size=512, num_attention_heads=8,
                            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                            mamba_n_heads=16)


def build_hf_model(family: str, small: bool, model_dir: str | None, device: str, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                   max_len: int):
    """(transformers model in `dtype` on `device`, a checkpoint directory the engine loads); a
    random model's positions reach at least `max_len`."""
    import transformers

    if model_dir is not None:
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return hf.eval(), model_dir
    if family == "deepseek":
        shape = SMALL if small else MID
        config = transformers.DeepseekV3Config(
            **dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], max_len)))
        model_cls = transformers.DeepseekV3ForCausalLM
    elif family == "llama":
        shape = LLAMA_SMALL if small else LLAMA_1B
        config = transformers.LlamaConfig(
            **dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], max_len)))
        model_cls = transformers.LlamaForCausalLM
    elif family == "qwen3-next":
        shape = QWEN3_NEXT_SMALL if small else QWEN3_NEXT
        config = transformers.Qwen3NextConfig(
            **dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], max_len)))
        model_cls = transformers.Qwen3NextForCausalLM
    elif family == "granite-hybrid":
        shape = GRANITE_HYBRID_SMALL if small else GRANITE_HYBRID
        config = transformers.GraniteMoeHybridConfig(
            **dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], max_len)))
        model_cls = transformers.GraniteMoeHybridForCausalLM
    else:  # granite-swa: transformers' default pattern (every fourth layer full) and sinks
        shape = LLAMA_SMALL if small else LLAMA_1B
        config = transformers.GraniteSWAConfig(
            **dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], max_len)),
            sliding_window=SWA_WINDOW)
        model_cls = transformers.GraniteSWAForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        hf = model_cls(config).to(dtype).eval()
    if family == "granite-swa":  # sinks start at zero: give them values that matter
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith("sinks"):
                    param.normal_(0, 1)
    directory = tempfile.mkdtemp(prefix="bench_e2e.")
    hf.save_pretrained(directory)
    return hf, directory


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ceilings(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) measured here."""
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ a
    sync(device)
    reps = 10 if device == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        a @ a
    sync(device)
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    x = torch.empty(256 * 2**20 if device == "cuda" else 64 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    bandwidth = 2 * x.numel() * reps / (time.perf_counter() - t)  # read + write
    return flops, bandwidth


def time_hf(model, prompts: torch.Tensor, new_tokens: int, device: str,  # type: ignore[no-untyped-def]
            threads: int | None = None) -> tuple[float, float]:
    """(time to first token, decode time after it) of one generate call, from the times its
    streamer is handed each step's tokens (generate reads every step's tokens on the host);
    `threads`: torch's intra-op thread count for the call (None: torch's as it is)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            """Nothing to flush: only the step times are kept (BaseStreamer requires the method)."""

    clock = Clock()
    pool = torch.get_num_threads()
    torch.set_num_threads(threads or pool)
    sync(device)
    start = time.perf_counter()
    model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        streamer=clock,
    )
    sync(device)
    end = time.perf_counter()
    torch.set_num_threads(pool)
    first = clock.times[1]  # times[0]: the prompt
    return first - start, end - first


def transformers_logprobs(directory: str, prompts: torch.Tensor, device: str, dtype: torch.dtype,
                          every_position: bool = False,
                          attach: Callable[[torch.nn.Module], object] | None = None) -> torch.Tensor:
    """log_softmax of transformers' logits, float32 on the CPU: [B, V] at each prompt's last
    position, or [B, S, V] at every position; `attach` sees the model before it runs (hooks).
    The model is loaded from `directory` in `dtype` as
    a user loads it: from_pretrained keeps the RoPE frequencies in float32 whatever the weights'
    dtype. (A model converted with .to(bfloat16) rounds them to bf16 too, and .float() does not
    restore them: a float32 reference made that way drifts from the checkpoint's own model with
    the position, 5% of q's RoPE part at position 511: benchmarks/notes_accuracy.md.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    if attach is not None:
        attach(model)
    with torch.no_grad():
        logits = model(prompts.to(device)).logits
        logits = logits if every_position else logits[:, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    del model, logits
    if device == "cuda":
        torch.cuda.empty_cache()
    return logprobs


def agreement(llm, directory: str, prompts: torch.Tensor, device: str,  # type: ignore[no-untyped-def]
              dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Per prompt, the max |logprob difference| over an engine's top-5 first tokens, against
    transformers in float32 on the same weights: (Jackfield in the bench dtype, transformers in
    the bench dtype). One prompt of a random MoE model in bf16 can sit on a routing knife-edge
    (a rounding flips an expert choice), so the pair is the comparison, over several prompts."""
    from jackfield import SamplingParams
    from jackfield.testing.accuracy import own_top5_errors, top5_error

    want = transformers_logprobs(directory, prompts, device, torch.float32)
    theirs = transformers_logprobs(directory, prompts, device, dtype)
    outs = llm.generate(
        [p.tolist() for p in prompts], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    )
    jf = [top5_error(out.logprobs[0], want[i]) for i, out in enumerate(outs)]
    return jf, own_top5_errors(theirs, want).tolist()  # transformers' over its own top 5


def time_engine(llm, prompts: torch.Tensor, params, device: str) -> tuple[float, float, list[list[int]]]:  # type: ignore[no-untyped-def]
    """(mean time to first token, decode tokens/s after the last first token, the tokens) of one
    generate call over `prompts`."""
    sync(device)
    start = time.perf_counter()
    outs = llm.generate([p.tolist() for p in prompts], params)
    sync(device)
    total = time.perf_counter() - start
    last_first = max(o.timings.time_to_first_token_s for o in outs)
    batch = len(outs)
    ttft = sum(o.timings.time_to_first_token_s for o in outs) / batch
    return ttft, batch * (params.max_tokens - 1) / (total - last_first), [o.token_ids for o in outs]


def greedy_agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Mean over requests of the share of tokens before the first that differs."""
    shares = []
    for g, w in zip(got, want, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
        shares.append(same / len(w))
    return sum(shares) / len(shares)


def compare_kv_cache_dtypes(args: argparse.Namespace, hf, directory: str, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The engine with the model-dtype KV cache, then with fp8_e4m3, at the same memory fraction
    (each engine freed before the next starts, so both see the same free memory)."""
    from jackfield import LLM, SamplingParams

    device = args.device
    gen = torch.Generator().manual_seed(1)
    checks = torch.randint(0, hf.config.vocab_size, (8, min(args.prompt_len, 512)), generator=gen)
    batches = [int(b) for b in args.batches.split(",")]
    vocab = hf.config.vocab_size
    prompts = {b: torch.randint(0, vocab, (b, args.prompt_len), generator=gen) for b in batches}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    runs: dict[str, dict] = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        llm = LLM(directory, **{
            "attention.backend": args.backend,
            "attention.kv_cache_dtype": kv_dtype,
            "engine.device": device,
            "model.dtype": str(dtype).removeprefix("torch."),
            "engine.max_num_seqs": max(batches),
            "engine.max_num_batched_tokens": args.max_batched_tokens,
            "engine.enable_prefix_caching": False,
            "engine.cuda_graphs": not args.no_cuda_graphs,
            "engine.async_scheduling": False if args.no_async_scheduling else None,  # None: the default
            "engine.max_model_len": args.prompt_len + args.new_tokens,
        })
        kv = llm.engine.runner.kv
        tensors = {t.data_ptr(): t for t in kv.layer_caches}.values()  # layers may share a tensor
        cache_bytes = sum(t.numel() * t.element_size() for t in tensors)
        run: dict = dict(backend=llm.engine.backend_choices["decode"].name,
                         kv_tokens=kv.num_blocks * kv.block_size, kv_gib=cache_bytes / 2**30,
                         bytes_per_token=cache_bytes / (kv.num_blocks * kv.block_size), rows={}, tokens={})
        # the scales calibrate on this first prefill (fp8): a random prompt like the timed ones
        run["logprob_error"], _ = agreement(llm, directory, checks, device, dtype)
        run["kv_cache"] = llm.engine.kv_cache_summary()
        for batch in batches:
            llm.generate([p.tolist() for p in prompts[batch]], SamplingParams(temperature=0.0, max_tokens=2))
            timed = [time_engine(llm, prompts[batch], params, device) for _ in range(args.repeats)]
            run["rows"][batch] = tuple(statistics.median(t[i] for t in timed) for i in (0, 1))
            run["tokens"][batch] = timed[0][2]
        runs[kv_dtype] = run
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    base, fp8 = runs["auto"], runs["fp8_e4m3"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\nmodel {args.model_dir or args.family}, device {name}, {dtype}, backend {fp8['backend']}, "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, max_num_batched_tokens "
          f"{args.max_batched_tokens}")
    label = str(dtype).removeprefix("torch.")
    for cache, run in ((label, base), ("fp8_e4m3", fp8)):
        errors = sorted(run["logprob_error"])
        print(f"{cache} cache: {run['bytes_per_token']:.0f} bytes a token, {run['kv_tokens']} tokens in "
              f"{run['kv_gib']:.2f} GiB (at most max_num_seqs x max_model_len); top-5 first-token logprobs "
              f"vs transformers float32, max |diff| median / max {errors[len(errors) // 2]:.4f} / "
              f"{errors[-1]:.4f}")
    scales = fp8["kv_cache"]["scales"]
    print(f"fp8 scales ({fp8['kv_cache']['scale_source']}): {len(scales)} layers, "
          f"{min(min(s) for s in scales):.4g}..{max(max(s) for s in scales):.4g}")
    print(f"KV capacity: the same memory holds {base['bytes_per_token'] / fp8['bytes_per_token']:.2f}x the "
          f"tokens in fp8 ({label}: {base['bytes_per_token']:.0f} bytes a token, fp8 "
          f"{fp8['bytes_per_token']:.0f})")
    print(f"| batch | {label} TTFT ms | fp8 TTFT ms | {label} decode tok/s | fp8 decode tok/s "
          f"| fp8 / {label} decode | greedy agreement |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for batch in batches:
        (b_ttft, b_dec), (f_ttft, f_dec) = base["rows"][batch], fp8["rows"][batch]
        agree = greedy_agreement(fp8["tokens"][batch], base["tokens"][batch])
        rows.append(dict(batch=batch, base_ttft_ms=b_ttft * 1e3, fp8_ttft_ms=f_ttft * 1e3,
                         base_decode_tok_s=b_dec, fp8_decode_tok_s=f_dec, fp8_decode_speedup=f_dec / b_dec,
                         greedy_agreement=agree))
        print(f"| {batch} | {b_ttft * 1e3:.1f} | {f_ttft * 1e3:.1f} | {b_dec:.1f} | {f_dec:.1f} | "
              f"{f_dec / b_dec:.2f} | {agree:.0%} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            per_token = {label: base["bytes_per_token"], "fp8_e4m3": fp8["bytes_per_token"]}
            json.dump(dict(device=name, dtype=str(dtype), backend=fp8["backend"], prompt_len=args.prompt_len,
                           kv_bytes_per_token=per_token, fp8_scales=fp8["kv_cache"], rows=rows), f, indent=2)


def profile_decode(llm, prompts: torch.Tensor, device: str) -> None:
    """Host time per op over a prefill and 4 decode steps (where the step's time goes)."""
    from jackfield import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        llm.generate(
            [p.tolist() for p in prompts], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        )
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    families = ("deepseek", "llama", "granite-swa", *HYBRIDS)
    parser.add_argument("--family", choices=families, default="deepseek")
    parser.add_argument("--model-dir", help="a real checkpoint instead of a random --family model")
    parser.add_argument("--small", action="store_true", help="the reduced config (for CPUs)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-new-tokens", type=int,
                        help="tokens transformers generates per timed run (default: --new-tokens; 16 for "
                             "the hybrid families, whose transformers decode steps are slow)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-batched-tokens", type=int, default=8192, help="engine.max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per batch (medians reported)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="engine.cuda_graphs = false")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="engine.async_scheduling = false (default: on for CUDA)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                        help="fp8_e4m3: the engine's fp8 against its model-dtype KV cache (docstring)")
    parser.add_argument("--cpu-threads", default="auto",
                        help="engine.cpu_threads (auto: measured at start-up); transformers keeps torch's")
    parser.add_argument("--hf-threads", type=int,
                        help="torch's thread count for transformers' generate calls (default: torch's own)")
    parser.add_argument("--json-out")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print a torch.profiler table of a few decode steps at the largest batch",
    )
    args = parser.parse_args()
    from jackfield import LLM, SamplingParams
    from jackfield.commands.run import cpu_threads_line

    started = time.perf_counter()

    def stage(done: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {done}", flush=True)

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hybrid = args.family in HYBRIDS and not args.model_dir
    hf_new_tokens = args.hf_new_tokens or (min(16, args.new_tokens) if hybrid else args.new_tokens)
    if hf_new_tokens != args.new_tokens:
        print(f"transformers generates {hf_new_tokens} tokens a timed run, Jackfield {args.new_tokens}: "
              f"transformers' {args.family} decode steps are slow, and its decode rate over "
              f"{hf_new_tokens - 1} steps is the same per-step rate")
    batches = [int(b) for b in args.batches.split(",")]
    hf, directory = build_hf_model(args.family, args.small, args.model_dir, device, dtype,
                                   args.prompt_len + args.new_tokens)
    stage("transformers model built and saved")
    if args.kv_cache_dtype == "fp8_e4m3":
        compare_kv_cache_dtypes(args, hf, directory, dtype)
        return
    config = hf.config
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    flops, bandwidth = ceilings(device, dtype)
    llm = LLM(
        directory,
        **{
            "attention.backend": args.backend,
            "engine.device": device,
            "model.dtype": str(dtype).removeprefix("torch."),
            "engine.max_num_batched_tokens": args.max_batched_tokens,
            "engine.max_num_seqs": max(batches),
            "engine.enable_prefix_caching": False,
            "engine.cuda_graphs": not args.no_cuda_graphs,
            "engine.async_scheduling": False if args.no_async_scheduling else None,  # None: the default
            "engine.cpu_threads": args.cpu_threads if args.cpu_threads == "auto" else int(args.cpu_threads),
        },
    )
    stage("engine loaded, warmed up and its graphs recorded")
    backend = llm.engine.backend_choices["decode"].name
    gen = torch.Generator().manual_seed(1)
    checks = torch.randint(0, config.vocab_size, (8, args.prompt_len), generator=gen)
    jf, tf = agreement(llm, directory, checks, device, dtype)
    print(
        f"top-5 first-token logprobs vs transformers float32 over {len(jf)} prompts, max |diff| "
        f"median / max: Jackfield {sorted(jf)[len(jf) // 2]:.4f} / {max(jf):.4f}, "
        f"transformers {dtype} {sorted(tf)[len(tf) // 2]:.4f} / {max(tf):.4f}"
    )
    stage("first-token logprobs compared")
    rows = []
    for batch in batches:
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=gen)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        # warm-up at the measured shapes, for both engines: kernel compiles and plan caches
        # (Triton, cuDNN) are one-time start-up costs, not time to first token
        llm.generate([p.tolist() for p in prompts], SamplingParams(temperature=0.0, max_tokens=2))
        hf_prompts = prompts.to(device)
        time_hf(hf, hf_prompts, 2, device, args.hf_threads)  # warm-up
        stage(f"batch {batch}: both warmed up")
        jf_runs, hf_runs = [], []
        for _ in range(args.repeats):  # interleaved, so a load spike on a shared host hits both
            sync(device)
            start = time.perf_counter()
            outs = llm.generate([p.tolist() for p in prompts], params)
            sync(device)
            total = time.perf_counter() - start
            last_first = max(o.timings.time_to_first_token_s for o in outs)
            jf_runs.append(
                (
                    sum(o.timings.time_to_first_token_s for o in outs) / batch,
                    batch * (args.new_tokens - 1) / (total - last_first),
                )
            )
            hf_ttft_s, hf_decode_s = time_hf(hf, hf_prompts, hf_new_tokens, device, args.hf_threads)
            hf_runs.append((hf_ttft_s, batch * (hf_new_tokens - 1) / hf_decode_s))
        jf_ttft, jf_decode = (statistics.median(r[i] for r in jf_runs) for i in (0, 1))
        hf_ttft, hf_decode = (statistics.median(r[i] for r in hf_runs) for i in (0, 1))
        ceiling = batch * bandwidth / weight_bytes
        rows.append(
            dict(
                batch=batch,
                jf_ttft_ms=jf_ttft * 1e3,
                hf_ttft_ms=hf_ttft * 1e3,
                jf_decode_tok_s=jf_decode,
                hf_decode_tok_s=hf_decode,
                decode_speedup=jf_decode / hf_decode,
                ttft_speedup=hf_ttft / jf_ttft,
                decode_vs_bandwidth_ceiling=jf_decode / ceiling,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        stage(f"batch {batch} timed")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"\nmodel {args.model_dir or args.family}, device {name}, {dtype}, backend {backend}, "
        f"weights {weight_bytes / 2**20:.0f} MiB, "
        f"prompt {args.prompt_len}, new tokens {args.new_tokens} (transformers {hf_new_tokens}), "
        f"max_num_batched_tokens {args.max_batched_tokens}, decode CUDA graphs: "
        f"{llm.engine.runner.decode_graphs_off or 'on'}, "
        f"async scheduling: {'on' if llm.engine.async_scheduling else 'off'}"
    )
    print(f"ceilings: matmul {flops / 1e9:.0f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    threads = llm.engine.runner.cpu_threads
    if threads is not None:  # the engine's steps' count; transformers runs at torch's
        print(f"transformers threads {args.hf_threads or torch.get_num_threads()}; engine "
              + cpu_threads_line(threads.summary()))
    if device == "cuda":  # the KV cache, both models and every captured graph's pool
        print(
            f"GPU memory: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, peak "
            f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        )
    print(
        "| batch | Jackfield TTFT ms | HF TTFT ms | Jackfield decode tok/s | HF decode tok/s | decode x HF "
        "| TTFT x HF | decode / bandwidth ceiling |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['jf_ttft_ms']:.1f} | {r['hf_ttft_ms']:.1f} | {r['jf_decode_tok_s']:.1f} | "
            f"{r['hf_decode_tok_s']:.1f} | {r['decode_speedup']:.2f} | {r['ttft_speedup']:.2f} | "
            f"{r['decode_vs_bandwidth_ceiling']:.3f} |"
        )
    if args.profile:
        profile_decode(llm, prompts, device)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                dict(
                    device=name,
                    dtype=str(dtype),
                    backend=backend,
                    weight_bytes=weight_bytes,
                    matmul_flops=flops,
                    bandwidth=bandwidth,
                    cpu_threads=threads and threads.summary(),
                    rows=rows,
                ),
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
