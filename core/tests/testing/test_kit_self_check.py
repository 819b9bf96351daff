"""Self-check of the conformance kit: every case it generates for torch_ref, run against torch_ref.

torch_ref is the kit's reference and claims every feature, so this checks the kit's own machinery
(case generation, problem builders, poisoned caches, comparisons) and torch_ref's validate() and
entry checks, not torch_ref's arithmetic: that is pinned against float64 formulas in
core/tests/attention and core/tests/ops, and the kit's power to catch bugs by the broken backends
of test_kit_catches_bugs.py. One self-check per kit test, each running all of that test's cases.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.testing import AttentionConformance


class TorchRefKit(AttentionConformance):
    backend_name = "torch_ref"
    dtypes = (torch.float32, torch.bfloat16)  # float16 takes the same paths as bfloat16


KIT = TorchRefKit()
CASES = KIT.cases(KIT.declared_backend())


@pytest.mark.parametrize("kit_test", sorted(CASES))
def test_kit_self_check_on_torch_ref(kit_test: str, rng_seed: int) -> None:
    method = getattr(KIT, kit_test)
    for case in CASES[kit_test]:
        gen = (
            {"gen": torch.Generator().manual_seed(rng_seed)}
            if "gen" in inspect.signature(method).parameters
            else {}
        )
        method(TorchRefBackend, case, **gen)


def test_every_kit_test_is_generated_for_a_backend_that_claims_everything() -> None:
    kit_tests = {name for name, _ in inspect.getmembers(AttentionConformance) if name.startswith("test_")}
    assert set(CASES) == kit_tests
    variants = {case.variant for case in CASES["test_attend_matches_reference"]}
    assert variants == {
        "causal",
        "non_causal",
        "sliding_window=1",
        "sliding_window=5",
        "sinks",
        "sparse_topk",
    }
    assert {case.variant for case in CASES["test_forward_matches_reference"]} == {"dense", "sparse_topk"}


def test_cases_are_exactly_what_the_record_declares() -> None:
    """An MLA-only record without features, one activation dtype and two cache dtypes: nothing else
    is generated (no MHA, no windows, sinks, top-k, non-causal or CUDA-graph cases)."""
    caps = dataclasses.replace(
        TorchRefBackend.capabilities,
        kinds=("mla",),
        activation_dtypes=(torch.bfloat16,),
        kv_cache_dtypes=("auto", "fp8_e4m3"),
        sliding_window=False,
        sinks=False,
        sparse_topk=False,
        non_causal=False,
    )
    narrow = type("narrow", (TorchRefBackend,), {"name": "narrow", "capabilities": caps})
    kit = AttentionConformance()
    cases = [case for kit_cases in kit.cases(narrow).values() for case in kit_cases]
    assert {(c.kind, c.dtype) for c in cases} == {("mla", torch.bfloat16)}
    assert {c.kv_cache_dtype for c in cases} == {"auto", "fp8_e4m3"}
    assert {c.variant for c in cases} == {"", "causal", "dense"}
    graphs = dataclasses.replace(caps, cuda_graph="uniform_decode")
    claims_graphs = type("claims_graphs", (TorchRefBackend,), {"name": "g", "capabilities": graphs})
    forward = kit.cases(claims_graphs)["test_forward_matches_reference"]
    assert [c.variant for c in forward].count("cuda_graph_decode") == 1
