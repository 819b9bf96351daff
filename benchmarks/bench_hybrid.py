"""The hybrid models' recurrent kernels on one GPU (ops/recurrent_triton.py) against the memory
floor measured in the same run, and against flash-linear-attention's gated-delta-rule kernels
when the `fla` package is importable (the column says "no fla" otherwise).

Run:  python benchmarks/bench_hybrid.py   (from a checkout; it puts core's sources on sys.path)

Shapes: Qwen3-Next-80B's linear attention (16 key heads, 32 value heads, Dk = Dv = 128) and
Granite-4.0-H-Small's Mamba2 (128 heads of 64, one group, state 128); inputs bf16, states
float32, slots shuffled in a pool of 512.
- Decode (one row per request): GPU time (triton.testing.do_bench_cudagraph, as engines replay
  decode), the bytes it must move (every state read and written once, plus the row's inputs and
  output), their rate and its ratio to the device-to-device copy bandwidth measured here.
  fla: fused_recurrent_gated_delta_rule on the same rows, its states contiguous (gathered from
  the slots outside the timing: fla reads states by sequence, not by slot).
- Prefill (every request T new tokens, from a zero state): the row-by-row kernel's time (the
  "us" column; what steps of at most 64 rows per request run), the chunked form's ("chunked
  us": the public op, which takes it for longer steps; for GDN two Triton kernels over the flat
  batch, for Mamba2 batched PyTorch within chunks and one Triton launch for the scan from chunk
  to chunk), the same bytes floor against the faster of the two, and fla's
  chunk_gated_delta_rule with its time ratio to the chunked form.
Each row ends with its wall time ("wall s": Triton compiles and fla's first-call autotuning
included) and prints our columns before fla runs, so a run stopped in fla's autotuning keeps them.

Options pick the rows: --decode 1,16 (batches; "" for none), --prefill 1x512,4x2048 (batch x
tokens per request; "" for none), --tables gdn,mamba, --no-fla (fla's columns left out). E.g.
our kernels on every row, then fla's chunked prefill on two:

  python benchmarks/bench_hybrid.py --no-fla
  python benchmarks/bench_hybrid.py --tables gdn --decode "" --prefill 1x4096,4x2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "core/src"))
from jackfield.ops.recurrent import gated_delta_rule, mamba2_scan, recurrent_metadata  # noqa: E402
from jackfield.ops.recurrent_triton import gated_delta_rule_triton, mamba2_scan_triton  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next-80B-A3B linear attention
MH, MP, MG, MN = 128, 64, 1, 128  # Granite-4.0-H-Small Mamba2
POOL = 512
DECODE = "1,16,64,256"  # batches of one row a request
PREFILL = "1x512,1x4096,4x2048,8x8192"  # batch x rows a request
ACT = torch.bfloat16

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None


def copy_gbs() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def gpu_ms(fn) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for the inputs
    return do_bench_cudagraph(fn, return_mode="median")


def metadata(batch: int, rows: int, has_state: bool):  # type: ignore[no-untyped-def]
    slots = torch.randperm(POOL)[:batch].tolist()
    return recurrent_metadata([rows] * batch, slots, [has_state] * batch, [], frozenset(), "cuda")


def gdn_inputs(tokens: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(tokens, HK, DK, device="cuda", generator=g).to(ACT)
    k = torch.randn(tokens, HK, DK, device="cuda", generator=g).to(ACT)
    v = torch.randn(tokens, HV, DV, device="cuda", generator=g).to(ACT)
    gate = -torch.rand(tokens, HV, device="cuda", generator=g)
    beta = torch.rand(tokens, HV, device="cuda", generator=g)
    return q, k, v, gate, beta


def gdn_bytes(tokens: int, batch: int) -> int:
    state = batch * HV * DK * DV * 4 * 2  # read and written once
    rows = tokens * (2 * HK * DK * 2 + HV * DV * 2 + 2 * HV * 4 + HV * DV * 4)  # q, k, v, g, beta in; out
    return state + rows


def fla_call(q, k, v, gate, beta, initial, batch, rows, chunked):  # type: ignore[no-untyped-def]
    """fla on the same rows: [1, T, H, D] with cu_seqlens, q and k expanded to the value heads."""
    expand = HV // HK
    qe, ke = (t.repeat_interleave(expand, dim=1).unsqueeze(0) for t in (q, k))
    cu = torch.arange(0, (batch + 1) * rows, rows, device="cuda", dtype=torch.int32)
    fn = chunk_gated_delta_rule if chunked else fused_recurrent_gated_delta_rule
    return lambda: fn(qe, ke, v.unsqueeze(0), g=gate.unsqueeze(0), beta=beta.unsqueeze(0),
                      initial_state=initial, output_final_state=True, cu_seqlens=cu,
                      use_qk_l2norm_in_kernel=True)


def gdn_table(copy: float, shapes: list[tuple[int, int]], fla: bool) -> None:
    print(f"\nGated delta rule (Qwen3-Next: Hk {HK}, Hv {HV}, Dk {DK}, Dv {DV}), copy {copy:.0f} GB/s")
    print(f"{'B':>4} {'T/req':>6} {'us':>9} {'chunked us':>10} {'MB':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'fla us':>9} {'fla/ours':>8} {'wall s':>7}")
    g = torch.Generator(device="cuda").manual_seed(0)
    states = torch.randn(POOL, HV, DK, DV, device="cuda", generator=g)
    for batch, rows in shapes:
        started = time.perf_counter()
        meta = metadata(batch, rows, has_state=rows == 1)
        q, k, v, gate, beta = gdn_inputs(batch * rows, g)

        def ours(q=q, k=k, v=v, gate=gate, beta=beta, meta=meta) -> torch.Tensor:
            return gated_delta_rule_triton(q, k, v, gate, beta, states, meta)

        def public(q=q, k=k, v=v, gate=gate, beta=beta, meta=meta) -> torch.Tensor:
            return gated_delta_rule(q, k, v, gate, beta, states, meta)  # chunked past 64 rows

        timer = gpu_ms if rows == 1 else (lambda fn: do_bench(fn, return_mode="median"))
        ms = timer(ours)
        chunked_ms = timer(public) if rows > 1 else ms
        best = min(ms, chunked_ms)
        moved = gdn_bytes(batch * rows, batch)
        rate = moved / best / 1e6
        print(f"{batch:>4} {rows:>6} {ms * 1e3:>9.1f} {chunked_ms * 1e3:>10.1f} {moved / 1e6:>8.1f} "
              f"{rate:>7.0f} {rate / copy:>7.0%} ", end="", flush=True)  # fmt: skip
        columns = "no fla" if fused_recurrent_gated_delta_rule is None else "fla off"
        if fla and fused_recurrent_gated_delta_rule is not None:
            initial = states[meta.state_slots].clone() if rows == 1 else None
            fla_ms = timer(fla_call(q, k, v, gate, beta, initial, batch, rows, chunked=rows > 1))
            columns = f"{fla_ms * 1e3:>9.1f} {fla_ms / chunked_ms:>8.2f}"
        print(f"{columns:>18} {time.perf_counter() - started:>7.1f}", flush=True)


def mamba_table(copy: float, shapes: list[tuple[int, int]]) -> None:
    print(f"\nMamba2 scan (Granite-4.0-H: H {MH}, P {MP}, G {MG}, N {MN}), copy {copy:.0f} GB/s")
    print(f"{'B':>4} {'T/req':>6} {'us':>9} {'chunked us':>10} {'MB':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'wall s':>7}")
    g = torch.Generator(device="cuda").manual_seed(1)
    states = torch.randn(POOL, MH, MP, MN, device="cuda", generator=g)
    a = -torch.rand(MH, device="cuda", generator=g) * 4
    d, bias = torch.randn(MH, device="cuda", generator=g), torch.randn(MH, device="cuda", generator=g)
    for batch, rows in shapes:
        started = time.perf_counter()
        tokens = batch * rows
        meta = metadata(batch, rows, has_state=rows == 1)
        x = torch.randn(tokens, MH, MP, device="cuda", generator=g).to(ACT)
        dt = torch.randn(tokens, MH, device="cuda", generator=g).to(ACT)
        b = torch.randn(tokens, MG, MN, device="cuda", generator=g).to(ACT)
        c = torch.randn(tokens, MG, MN, device="cuda", generator=g).to(ACT)

        def ours(x=x, dt=dt, b=b, c=c, meta=meta) -> torch.Tensor:
            return mamba2_scan_triton(x, dt, a, b, c, d, bias, (0.0, float("inf")), states, meta)

        def public(x=x, dt=dt, b=b, c=c, meta=meta) -> torch.Tensor:
            return mamba2_scan(x, dt, a, b, c, d, bias, (0.0, float("inf")), states, meta)

        timer = gpu_ms if rows == 1 else (lambda fn: do_bench(fn, return_mode="median"))
        ms = timer(ours)
        chunked_ms = timer(public) if rows > 1 else ms
        best = min(ms, chunked_ms)
        moved = batch * MH * MP * MN * 4 * 2 + tokens * (MH * MP * 2 + MH * 2 + 2 * MG * MN * 2 + MH * MP * 4)
        print(f"{batch:>4} {rows:>6} {ms * 1e3:>9.1f} {chunked_ms * 1e3:>10.1f} {moved / 1e6:>8.1f} "
              f"{moved / best / 1e6:>7.0f} {moved / best / 1e6 / copy:>7.0%} "
              f"{time.perf_counter() - started:>7.1f}", flush=True)  # fmt: skip


def shapes(decode: str, prefill: str) -> list[tuple[int, int]]:
    """(batch, rows a request) of the table rows: --decode "1,16" and --prefill "1x512,4x2048"."""
    rows = [(int(b), 1) for b in decode.split(",") if b]
    for item in filter(None, prefill.split(",")):
        batch, tokens = item.split("x")
        rows.append((int(batch), int(tokens)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", default=DECODE, help="decode batches, comma-separated")
    parser.add_argument("--prefill", default=PREFILL, help="prefill rows: BATCHxTOKENS, comma-separated")
    parser.add_argument("--tables", default="gdn,mamba", help="gdn, mamba or both")
    parser.add_argument("--no-fla", action="store_true", help="leave fla's columns out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hybrid needs a CUDA GPU")
    fla = "fla importable" if chunk_gated_delta_rule is not None else "fla not importable: its columns say so"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; {fla}")
    rows, tables = shapes(args.decode, args.prefill), args.tables.split(",")
    copy = copy_gbs()
    if "gdn" in tables:
        gdn_table(copy, rows, fla=not args.no_fla)
    if "mamba" in tables:
        mamba_table(copy, rows)


if __name__ == "__main__":
    main()
