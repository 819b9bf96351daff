"""The kit must fail real bugs: each broken torch_ref variant below trips the test meant for it."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jackfield.attention.kv_cache import write_slots
from jackfield.attention.torch_ref import TorchRefBackend, TorchRefMHAImpl, TorchRefMLAImpl
from jackfield.contracts.attention import (
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionOutput,
)
from jackfield.testing import AttentionConformance
from jackfield.testing.harness import Case

FAILED = (AssertionError, pytest.fail.Exception)


def _backend(name: str, mha: type, mla: type = TorchRefMLAImpl) -> type[TorchRefBackend]:
    def make_impl(cls, layer: AttentionLayerSpec):
        return mla(layer) if layer.kv_lora_rank else mha(layer)

    return type(name, (TorchRefBackend,), {"name": name, "make_impl": classmethod(make_impl)})


class ShuffledBlocks(TorchRefMHAImpl):
    def attend(self, query, kv_cache, metadata, **kw):
        order = torch.arange(metadata.block_table.numel(), dtype=torch.int32).view_as(metadata.block_table)
        return super().attend(query, kv_cache, metadata.replace(block_table=order % kv_cache.shape[1]), **kw)


class ReadsWholeBlocks(TorchRefMHAImpl):
    """Attends non-causally over every slot of every block it touches (the tail is poison)."""

    def attend(self, query, kv_cache, metadata, **kw):
        bs = kv_cache.shape[2]
        padded = (metadata.seq_lens_cpu + bs - 1) // bs * bs
        return super().attend(query, kv_cache, metadata.replace(seq_lens_cpu=padded, causal=False), **kw)


class IgnoresWindow(TorchRefMHAImpl):
    def attend(self, query, kv_cache, metadata, **kw):
        saved, self.layer = self.layer, AttentionLayerSpec(**{**self.layer.__dict__, "sliding_window": None})
        try:
            return super().attend(query, kv_cache, metadata, **kw)
        finally:
            self.layer = saved


class IgnoresSinks(TorchRefMHAImpl):
    def attend(self, query, kv_cache, metadata, *, sinks=None, **kw):
        return super().attend(query, kv_cache, metadata, **kw)


class LseOffByOne(TorchRefMHAImpl):
    def attend(self, query, kv_cache, metadata, **kw):
        res = super().attend(query, kv_cache, metadata, **kw)
        return AttentionOutput(res.out, None if res.lse is None else res.lse + 1e-2)


class ScribblesOnCache(TorchRefMHAImpl):
    def attend(self, query, kv_cache, metadata, **kw):
        res = super().attend(query, kv_cache, metadata, **kw)
        kv_cache.view(torch.uint8)[0, 0, 0, 0, 0] ^= 1
        return res


class UncheckedWrite(TorchRefMHAImpl):
    """Writes without entry checks and without the fp8 scale."""

    def write_kv(self, kv_cache, slot_mapping, key, value, kv_scale=None):
        for half, rows in ((kv_cache[0], key), (kv_cache[1], value)):
            write_slots(half.flatten(0, 1), slot_mapping, rows.to(kv_cache.dtype))


class DropsPrefillContext(TorchRefMLAImpl):
    """Prefill that forgets the chunked-prefill context (only this step's tokens)."""

    def prefill(self, q, kv_cache, metadata, *, kv_scale=None):
        q_lens = metadata.query_start_loc_cpu.diff().to(torch.int32)
        return super().prefill(q, kv_cache, metadata.replace(seq_lens_cpu=q_lens), kv_scale=kv_scale)


class Kit(AttentionConformance):
    dtypes = (torch.float32,)


def mha(variant: str = "") -> Case:
    return Case("mha", torch.float32, "auto", variant)


@pytest.fixture
def gen(rng_seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(rng_seed)


@pytest.mark.parametrize(
    "impl, test, case",
    [
        (ShuffledBlocks, "test_attend_matches_reference", mha("causal")),
        (ReadsWholeBlocks, "test_attend_matches_reference", mha("causal")),
        (IgnoresWindow, "test_attend_matches_reference", mha("sliding_window=5")),
        (IgnoresSinks, "test_attend_matches_reference", mha("sinks")),
        (LseOffByOne, "test_attend_matches_reference", mha("causal")),
        (ScribblesOnCache, "test_attend_matches_reference", mha("causal")),
        (UncheckedWrite, "test_write_kv_matches_reference", Case("mha", torch.float32, "fp8_e4m3")),
        (UncheckedWrite, "test_bad_inputs_are_rejected_at_the_entry", mha()),
    ],
    ids=lambda v: v.id if isinstance(v, Case) else getattr(v, "__name__", str(v)),
)
def test_broken_mha_backend_fails_the_kit(impl: type, test: str, case: Case, gen: torch.Generator) -> None:
    backend = _backend(f"broken_{impl.__name__}", impl)
    with pytest.raises(FAILED):
        getattr(Kit(), test)(backend, case, gen)


def test_broken_mla_prefill_fails_forward(gen: torch.Generator) -> None:
    backend = _backend("broken_mla", TorchRefMHAImpl, DropsPrefillContext)
    with pytest.raises(FAILED):
        Kit().test_forward_matches_reference(backend, Case("mla", torch.float32, "auto", "dense"), gen)


def test_graph_claim_of_a_backend_that_reads_host_lengths_fails(gen: torch.Generator) -> None:
    """torch_ref plans from the host's seq_lens_cpu, which a CUDA-graph replay only bounds: a
    claim of cuda_graph support must not survive the kit."""
    caps = dataclasses.replace(TorchRefBackend.capabilities, cuda_graph="uniform_decode")
    claims = type("claims_graphs", (TorchRefBackend,), {"name": "claims_graphs", "capabilities": caps})
    case = Case("mla", torch.float32, "auto", "cuda_graph_decode")
    assert case in Kit().cases(claims)["test_forward_matches_reference"]
    with pytest.raises(FAILED):
        Kit().test_forward_matches_reference(claims, case, gen)


class StagedQueryOffsets(AttentionMetadataBuilder):
    """Keeps the step's CPU query offsets in a buffer it reuses from build to build (as a backend
    staging them for its kernel would). `capture_buffer`: whether a capture-time build stages
    into a buffer of its own, as the contract asks, or into the run-time one."""

    capture_buffer = True

    def __init__(self) -> None:
        self.offsets = torch.zeros(64, dtype=torch.int32)

    def build(self, common: AttentionMetadata, for_capture: bool = False) -> AttentionMetadata:
        n = common.num_reqs + 1
        staged = torch.zeros(64, dtype=torch.int32) if for_capture and self.capture_buffer else self.offsets
        staged[:n] = common.query_start_loc_cpu
        return common.replace(query_start_loc_cpu=staged[:n])


class CaptureClobbersQueryOffsets(StagedQueryOffsets):
    capture_buffer = False


@pytest.mark.parametrize("builder, broken",
                         [(StagedQueryOffsets, False), (CaptureClobbersQueryOffsets, True)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_capture_build_that_clobbers_run_time_offsets_fails(
    builder: type[AttentionMetadataBuilder], broken: bool, gen: torch.Generator
) -> None:
    """The kit's builder test fails a capture-time build that writes the run-time CPU query
    offsets, and passes the same builder once its capture-time build stages into its own buffer."""
    backend = type("staged", (TorchRefBackend,), {"name": "staged", "metadata_builder": classmethod(
        lambda cls: builder())})
    if broken:
        with pytest.raises(FAILED, match="query_start_loc_cpu"):
            Kit().test_capture_build_leaves_run_time_metadata_intact(backend, mha(), gen)
    else:
        Kit().test_capture_build_leaves_run_time_metadata_intact(backend, mha(), gen)


def test_overclaiming_validate_fails() -> None:
    class SaysYes(TorchRefBackend):
        capabilities = dataclasses.replace(TorchRefBackend.capabilities, sinks=False)

        @classmethod
        def validate(cls, req):
            return []

    with pytest.raises(FAILED, match="sinks"):
        Kit().test_validate_rejects_what_capabilities_do_not_claim(SaysYes, mha())


def test_underclaiming_validate_fails() -> None:
    """A validate() that refuses a feature the record claims fails the kit too."""

    class SaysNoToSinks(TorchRefBackend):
        @classmethod
        def validate(cls, req):
            return ["sinks not supported"] if req.sinks else []

    with pytest.raises(FAILED):
        Kit().test_validate_accepts_what_capabilities_claim(SaysNoToSinks, mha())


BROKEN_SUITE = """
import torch
from jackfield.attention.torch_ref import TorchRefBackend, TorchRefMHAImpl, TorchRefMLAImpl
from jackfield.testing import AttentionConformance
from jackfield.testing.harness import Case


class IgnoresSinks(TorchRefMHAImpl):
    def attend(self, query, kv_cache, metadata, *, sinks=None, **kw):
        return super().attend(query, kv_cache, metadata, **kw)


class Broken(TorchRefBackend):
    name = "broken"

    @classmethod
    def make_impl(cls, layer):
        return TorchRefMLAImpl(layer) if layer.kv_lora_rank else IgnoresSinks(layer)


class TestBroken(AttentionConformance):
    backend_cls = Broken
    dtypes = (torch.float32,)
"""


def test_pytest_fails_the_generated_suite_of_a_broken_backend(tmp_path: Path) -> None:
    """Through pytest itself: the suite the kit generates for a backend whose MHA attend drops the
    sinks runs with nothing skipped and fails exactly the MHA sinks case."""
    (tmp_path / "test_broken.py").write_text(BROKEN_SUITE)
    pytest_args = ["-q", "-p", "no:cacheprovider", "-k", "attend and not mla", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "FAILED test_broken.py::TestBroken::test_attend_matches_reference[mha-float32-kv_auto-sinks]"
        in result.stdout
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"1 failed, \d+ passed, \d+ deselected in .*", summary), summary


def test_registry_lookup_and_unknown_name() -> None:
    from jackfield.testing.checks import resolve_backend

    assert resolve_backend("torch_ref", None) is TorchRefBackend
    with pytest.raises(KeyError, match="no attention named 'nope'"):
        resolve_backend("nope", None)
    with pytest.raises(pytest.fail.Exception, match="backend_name"):
        resolve_backend(None, None)
