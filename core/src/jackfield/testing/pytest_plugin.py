"""pytest plugin of the conformance kit (entry point `jackfield`): the `gpu` marker and test seeds.

Tests marked `gpu` are skipped when CUDA is absent.

Seeds: the session draws one seed (or takes JACKFIELD_TEST_SEED), shown in the report header.
Each test's seed derives from it and the test's id, so it does not depend on which other tests
run or in what order; the autouse fixture `rng_seed` seeds `random`, torch and numpy with it
before the test and hands it to tests that build their own generators. A failing test's report
repeats both seeds: `JACKFIELD_TEST_SEED=<session seed> pytest <test id>` draws the same inputs.

torch is imported only if a test needs it, so loading this plugin costs nothing at pytest start.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import pytest

GPU_SKIP_REASON = "needs a CUDA GPU"
SEED_ENV = "JACKFIELD_TEST_SEED"
_session_seed = pytest.StashKey[int]()
_test_seed = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    worker_input = getattr(config, "workerinput", None)  # a pytest-xdist worker: the controller's seed
    config.stash[_session_seed] = (
        int(worker_input[SEED_ENV]) if worker_input is not None else _seed_from_environment()
    )


def _seed_from_environment() -> int:
    value = os.environ.get(SEED_ENV)
    if value is None:
        return random.SystemRandom().getrandbits(32)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {value!r}") from None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # type: ignore[no-untyped-def]  # pytest-xdist's hook
    node.workerinput[SEED_ENV] = node.config.stash[_session_seed]


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[_session_seed]
    return f"jackfield test seed: {seed} (reproduce with {SEED_ENV}={seed})"


def seed_of_test(session_seed: int, test_id: str) -> int:
    """The seed of test `test_id` in a session seeded with `session_seed` (32 bits, numpy's limit)."""
    digest = hashlib.blake2b(f"{session_seed}:{test_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@pytest.fixture(autouse=True)
def rng_seed(request: pytest.FixtureRequest) -> int:
    """This test's seed; `random`, torch and numpy (where imported) are seeded with it."""
    seed = seed_of_test(request.config.stash[_session_seed], request.node.nodeid)
    request.node.stash[_test_seed] = seed
    random.seed(seed)
    if (torch := sys.modules.get("torch")) is not None:
        torch.manual_seed(seed)
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed(seed)
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.failed and _test_seed in item.stash:
        session = item.config.stash[_session_seed]
        report.sections.append(
            ("jackfield seed", f"{SEED_ENV}={session} (this test's seed: {item.stash[_test_seed]})")
        )
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)
