"""Running a script or module under torchrun from a test, with a timeout that reports instead of
hanging (a rank that dies or diverges leaves the others waiting in a collective)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import pytest


def torchrun(nproc: int, target: Sequence[str], timeout_s: float,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node nproc *target`: its
    completed process, or a test failure with the output's tail when it fails or outlives
    `timeout_s` (its whole process group is killed then)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *target]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, env={**os.environ, **(env or {})}) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"torchrun {' '.join(target)} ran past {timeout_s} s (killed); its output:\n"
                        f"{stdout[-3000:]}\n{stderr[-6000:]}")
    if process.returncode != 0:
        pytest.fail(f"torchrun {' '.join(target)} exited {process.returncode}:\n"
                    f"{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
