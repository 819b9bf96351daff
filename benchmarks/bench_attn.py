"""cuda_attn on one GPU: paged decode and prefill against ceilings measured in the same run.

Run:  python benchmarks/bench_attn.py   (from a checkout; it puts core's and the plugin's sources
on sys.path itself)

Shapes: GQA with 32 query and 8 KV heads, head size 128, bf16, block size = the backend's
preferred one, pages shuffled.
- Decode (one query row per request): GPU time (median of triton.testing.do_bench_cudagraph: the
  call recorded in a CUDA graph and replayed, as engines run decode), the KV bytes it must read
  (every key and value once), the bandwidth that makes, its ratio to the device-to-device copy
  bandwidth measured here (torch copy of 2 GiB, bytes read + written), the split count and the
  host time of one eager call (benchmarks/gpu_timing.host_us). Target (issue 19): >= 85% of copy
  at B 64-128, S 4096-8192. Where vLLM is importable, its Triton decode kernel
  (vllm.v1.attention.ops.triton_decode_attention: the lightllm kernel SGLang's triton backend runs
  too) reads the same paged cache in the same process, timed the same way at its fastest split
  count among 4-32 (vLLM/ours: its time over ours), with the largest difference of its output
  from ours.
- Prefill (causal, every request S new tokens): the paged kernel against unpaged
  scaled_dot_product_attention with the flash backend forced, on the same data (its K/V
  expanded to the 32 query heads beforehand, outside the timing). Two timings of each: GPU time
  (graph replay, as above: the kernels' own speed) and eager calls back to back (do_bench: at
  small shapes this is the host's launch time, not the kernel's). Target: within 1.2x of SDPA
  flash's GPU time. FLOPs: 4 * B * H * D * S(S+1)/2.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from triton.testing import do_bench, do_bench_cudagraph

# Runs from a checkout: this folder (gpu_timing) and the sources of core and the plugin.
HERE = os.path.dirname(os.path.abspath(__file__))
for path in ("core/src", "plugins/cuda_attn/src"):
    sys.path.insert(0, os.path.join(HERE, "..", path))
sys.path.insert(0, HERE)
from gpu_timing import host_us  # noqa: E402
from jackfield_cuda_attn.capabilities import CUDA_ATTN_CAPABILITIES  # noqa: E402
from jackfield_cuda_attn.kernels import paged_attention  # noqa: E402
from jackfield_cuda_attn.kernels.attention import decode_splits  # noqa: E402

try:  # the baseline a vLLM / SGLang user on Triton runs; optional
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd as vllm_decode
except ImportError:
    vllm_decode = None

HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128
DTYPE = torch.bfloat16
PAGE = CUDA_ATTN_CAPABILITIES.preferred_block_size or 64
DECODE = [(b, s) for b in (1, 16, 64, 128) for s in (1024, 4096, 8192)]
PREFILL = [(b, s) for b in (1, 8) for s in (512, 2048, 8192)]


def copy_gbs() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def paged_case(batch: int, seq: int, q_len: int) -> dict:
    """A cache holding `batch` requests of `seq` tokens on shuffled pages, and q_len queries each."""
    pages = seq // PAGE
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, batch * pages, PAGE, KV_HEADS, HEAD_SIZE, device="cuda", generator=g).to(DTYPE)
    table = torch.randperm(batch * pages, device="cuda", generator=g).int().view(batch, pages)
    query = torch.randn(batch * q_len, HEADS, HEAD_SIZE, device="cuda", generator=g).to(DTYPE)
    return dict(
        query=query,
        cache=cache,
        table=table,
        seq_lens=torch.full((batch,), seq, device="cuda", dtype=torch.int32),
        starts=torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32),
        seq=seq,
        q_len=q_len,
    )


def run(c: dict) -> torch.Tensor:
    decode = c["q_len"] == 1
    reqs = c["seq_lens"].numel()
    return paged_attention(
        c["query"], c["cache"], c["table"], c["seq_lens"], c["starts"],
        decode_reqs=reqs if decode else 0, decode_rows=c["query"].shape[0] if decode else 0,
        decode_query_len=1 if decode else 0, max_seq_len=c["seq"], sm_scale=HEAD_SIZE**-0.5,
    )[0]  # fmt: skip


def gpu_ms(fn) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for the inputs
    return do_bench_cudagraph(fn, return_mode="median")


def vllm_decode_best(c: dict, ours: torch.Tensor) -> tuple[str, float]:
    """vLLM's Triton decode on case `c`'s cache and block table: (its GPU time at its fastest split
    count among 4-32, that count and the largest |difference| from `ours`, as table columns; that
    time in ms)."""
    batch = c["seq_lens"].numel()
    out = torch.full_like(c["query"], float("nan"))
    lse = torch.empty(batch, HEADS, dtype=torch.float32, device="cuda")
    unit_scale = torch.ones((), dtype=torch.float32, device="cuda")  # as vLLM's layer passes its bf16 scales
    timed = []
    for splits in (4, 8, 16, 32):
        partial = torch.empty(batch, HEADS, splits, HEAD_SIZE + 1, dtype=torch.float32, device="cuda")

        def call(partial=partial, splits=splits) -> None:
            key_cache, value_cache = c["cache"]
            vllm_decode(c["query"], key_cache, value_cache, out, lse, c["table"], c["seq_lens"], partial,
                        splits, HEAD_SIZE**-0.5, PAGE, k_scale=unit_scale, v_scale=unit_scale)  # fmt: skip

        timed.append((gpu_ms(call), splits, call))
    ms, splits, call = min(timed)
    call()
    err = (out.float() - ours.float()).abs().max().item()
    return f"{ms * 1e3:>9.1f} {splits:>6} {err:>8.1e}", ms


def decode_table(copy: float) -> None:
    print(f"\nDecode, GQA {HEADS}/{KV_HEADS}, D {HEAD_SIZE}, bf16, block {PAGE}; copy {copy:.0f} GB/s")
    vllm_head = f" {'vLLM us':>9} {'splits':>6} {'max err':>8} {'vLLM/ours':>9}" if vllm_decode else ""
    print(
        f"{'B':>4} {'S':>6} {'splits':>6} {'us':>9} {'KV MB':>8} {'GB/s':>7} {'of copy':>8} {'host us':>8}"
        + vllm_head
    )
    for batch, seq in DECODE:
        c = paged_case(batch, seq, 1)
        splits = decode_splits(batch, KV_HEADS, seq, c["query"].device)  # one program per KV head
        kv_bytes = c["cache"].numel() * c["cache"].element_size()
        ms = gpu_ms(lambda c=c: run(c))
        host = host_us(lambda c=c: run(c))
        gbs = kv_bytes / ms / 1e6
        baseline = ""
        if vllm_decode is not None:
            figures, vllm_ms = vllm_decode_best(c, run(c))
            baseline = f" {figures} {vllm_ms / ms:>9.2f}"
        print(f"{batch:>4} {seq:>6} {splits:>6} {ms * 1e3:>9.1f} {kv_bytes / 1e6:>8.1f} {gbs:>7.0f} "
              f"{gbs / copy:>7.0%} {host:>8.1f}{baseline}", flush=True)  # fmt: skip
        del c


def prefill_table() -> None:
    print(
        f"\nPrefill, causal, GQA {HEADS}/{KV_HEADS}, D {HEAD_SIZE}, bf16, block {PAGE}; GPU time (graph "
        "replay) and eager calls"
    )
    print(f"{'B':>4} {'S':>6} {'GPU us':>8} {'TFLOP/s':>8} {'SDPA us':>8} {'SDPA TF/s':>9} {'time/SDPA':>9} "
          f"{'eager us':>9} {'SDPA eager':>10} {'eager/SDPA':>10} {'max err':>8}")  # fmt: skip
    for batch, seq in PREFILL:
        c = paged_case(batch, seq, seq)
        flops = 4 * batch * HEADS * HEAD_SIZE * seq * (seq + 1) / 2
        # The same keys and values, unpaged [B, H, S, D] (expanded to the query heads) for SDPA.
        slots = (c["table"].long()[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten(1)
        k, v = (c["cache"][i].flatten(0, 1)[slots] for i in (0, 1))  # [B, S, H_kv, D]
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2).contiguous() for t in (k, v))
        q = c["query"].view(batch, seq, HEADS, HEAD_SIZE).transpose(1, 2).contiguous()

        def sdpa(q=q, k=k, v=v) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return scaled_dot_product_attention(q, k, v, is_causal=True)

        ms, ref_ms = gpu_ms(lambda c=c: run(c)), gpu_ms(sdpa)
        eager_ms = do_bench(lambda c=c: run(c), return_mode="median")
        ref_eager_ms = do_bench(sdpa, return_mode="median")
        ours = run(c).view(batch, seq, HEADS, HEAD_SIZE)
        err = (ours.float() - sdpa().transpose(1, 2).float()).abs().max().item()
        print(f"{batch:>4} {seq:>6} {ms * 1e3:>8.1f} {flops / ms / 1e9:>8.0f} {ref_ms * 1e3:>8.1f} "
              f"{flops / ref_ms / 1e9:>9.0f} {ms / ref_ms:>9.2f} {eager_ms * 1e3:>9.1f} "
              f"{ref_eager_ms * 1e3:>10.1f} {eager_ms / ref_eager_ms:>10.2f} {err:>8.1e}",
              flush=True)  # fmt: skip
        del c, k, v, q


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_attn needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    decode_table(copy_gbs())
    prefill_table()


if __name__ == "__main__":
    main()
