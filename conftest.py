"""Repo-wide pytest setup.

Without CUDA, Triton kernels run in the CPU interpreter: set here, before any test module imports
triton, so every package's Triton tests agree.

Skips are counted and printed at the end, grouped by reason, and a skip for any reason but
missing hardware fails the run: CI (no GPU, no AVX-512, no AMX) must run every other test.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from jackfield.testing.pytest_plugin import GPU_SKIP_REASON

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist the workers share the cores: with more threads than cores in all, OpenMP
# threads spin in one worker while another waits for the core (measured: 2-3x the CPU time).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))

# The only reasons a test may skip for: hardware that CI's machine lacks. A reason is allowed
# when it is one of these or starts with one and a colon (the detail follows).
HARDWARE_SKIP_REASONS = (
    GPU_SKIP_REASON,  # the `gpu` marker, and conformance classes on a CUDA device
    "needs AMX hardware",  # plugins/cpu_amx: AMX-BF16 tiles granted by the OS
    "needs AVX-512-BF16 hardware",  # plugins/cpu_amx: the kernel's AVX-512 build (AMX hosts have it)
    "needs two GPUs",  # core/tests/distributed/test_nccl.py on a one-GPU machine
)

_skips: Counter[str] = Counter()


def is_hardware_skip(reason: str) -> bool:
    return any(reason == allowed or reason.startswith(allowed + ":") for allowed in HARDWARE_SKIP_REASONS)


def _count_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is reported as skipped
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    _skips[reason.removeprefix("Skipped: ")] += 1


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _count_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _count_skip(report)


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # workers' reports reach the controller's hooks too


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_xdist_worker(session.config):
        return
    if exitstatus == pytest.ExitCode.OK and any(not is_hardware_skip(reason) for reason in _skips):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if _is_xdist_worker(config) or not _skips:
        return
    terminalreporter.write_sep("=", f"{sum(_skips.values())} skipped, by reason")
    for reason, count in sorted(_skips.items(), key=lambda item: (is_hardware_skip(item[0]), -item[1])):
        kind = "hardware" if is_hardware_skip(reason) else "NOT ALLOWED"
        terminalreporter.write_line(f"{count:5d}  {kind:11s}  {reason}")
    disallowed = sum(count for reason, count in _skips.items() if not is_hardware_skip(reason))
    if disallowed:
        terminalreporter.write_line(
            f"{disallowed} tests skipped for a reason other than missing hardware; allowed: "
            f"{', '.join(HARDWARE_SKIP_REASONS)} (conftest.py). The run fails.",
            red=True,
        )
