"""bench_mla.py's default rows over several fresh processes: the median and the spread.

Why: a single process's figure can mislead (on the H200, eager do_bench figures moved between
processes by up to 2.5x; they measured the host's launch, PERF_NOTES.md round 5). Each child is
`bench_mla.py --only CASES --no-insert` (its own ceilings, allocations and Triton launch), and this
prints, per case, the median, lowest and highest GPU time (CUDA-graph replay) and the median share
of the copy bandwidth each child measured itself.

Run:  PYTHONPATH=core/src:plugins/cuda_mla/src python benchmarks/bench_mla_spread.py
          --processes 4 --only "H16 S4096 q1"
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROW = re.compile(r"^\| (?P<case>[^|]+?) \| (?P<us>[\d.]+) \| (?P<gbs>\d+) \| (?P<share>\d+)% \|")


def child_rows(only: str) -> dict[str, tuple[float, float]]:
    """One fresh process of bench_mla.py: case -> (us, share of its copy bandwidth)."""
    script = Path(__file__).with_name("bench_mla.py")
    done = subprocess.run(
        [sys.executable, str(script), "--only", only, "--no-insert"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"bench_mla.py failed:\n{done.stderr[-2000:]}")
    rows = {}
    for line in done.stdout.splitlines():
        match = ROW.match(line)
        if match:
            rows[match["case"]] = (float(match["us"]), int(match["share"]) / 100)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--only", default="H16 S4096 q1", help="bench_mla.py --only (comma-separated)")
    args = parser.parse_args()
    if args.processes < 1:
        raise SystemExit("--processes must be >= 1")
    runs = [child_rows(args.only) for _ in range(args.processes)]
    print(f"{args.processes} processes of bench_mla.py --only {args.only!r} (default kernels)")
    print("| case | median us | lowest | highest | median of copy BW | per process (us) |")
    print("|---|---|---|---|---|---|")
    for case in runs[0]:
        times = [run[case][0] for run in runs if case in run]
        shares = [run[case][1] for run in runs if case in run]
        each = " / ".join(f"{t:.1f}" for t in times)
        print(
            f"| {case} | {statistics.median(times):.1f} | {min(times):.1f} | {max(times):.1f} | "
            f"{statistics.median(shares):.0%} | {each} |"
        )


if __name__ == "__main__":
    main()
