"""The kit must fail real bugs: each broken torch_ref variant below trips the test meant for it."""

import dataclasses

import pytest
import torch
from jackfield.attention.kv_cache import write_slots
from jackfield.attention.torch_ref import TorchRefBackend, TorchRefMHAImpl, TorchRefMLAImpl
from jackfield.contracts.attention import AttentionLayerSpec, AttentionOutput
from jackfield.testing import AttentionConformance

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
    dtype = torch.float32


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "impl, test, args",
    [
        (ShuffledBlocks, "test_attend_matches_reference", (True,)),
        (ReadsWholeBlocks, "test_attend_matches_reference", (True,)),
        (IgnoresWindow, "test_attend_sliding_window", (5,)),
        (IgnoresSinks, "test_attend_sinks", ()),
        (LseOffByOne, "test_attend_matches_reference", (True,)),
        (ScribblesOnCache, "test_attend_matches_reference", (True,)),
        (UncheckedWrite, "test_write_kv_matches_reference", ()),
        (UncheckedWrite, "test_bad_inputs_are_rejected_at_the_entry", ()),
    ],
)
def test_broken_mha_backend_fails_the_kit(impl: type, test: str, args: tuple, gen: torch.Generator) -> None:
    backend = _backend(f"broken_{impl.__name__}", impl)
    with pytest.raises(FAILED):
        getattr(Kit(), test)(backend, "mha", *args, gen)


def test_broken_mla_prefill_fails_forward(gen: torch.Generator) -> None:
    backend = _backend("broken_mla", TorchRefMHAImpl, DropsPrefillContext)
    with pytest.raises(FAILED):
        Kit().test_forward_matches_reference(backend, "mla", False, gen)


def test_graph_claim_of_a_backend_that_reads_host_lengths_fails(gen: torch.Generator) -> None:
    """torch_ref plans from the host's seq_lens_cpu, which a CUDA-graph replay only bounds: a
    claim of cuda_graph support must not survive the kit."""
    caps = dataclasses.replace(TorchRefBackend.capabilities, cuda_graph="uniform_decode")
    claims = type("claims_graphs", (TorchRefBackend,), {"name": "claims_graphs", "capabilities": caps})
    with pytest.raises(FAILED):
        Kit().test_graph_style_decode_with_padded_rows(claims, "mla", gen)


def test_overclaiming_validate_fails(gen: torch.Generator) -> None:
    class SaysYes(TorchRefBackend):
        capabilities = TorchRefBackend.capabilities.__class__(
            **{**TorchRefBackend.capabilities.__dict__, "sinks": False}
        )

        @classmethod
        def validate(cls, req):
            return []

    with pytest.raises(FAILED, match="sinks"):
        Kit().test_validate_rejects_what_capabilities_do_not_claim(SaysYes, "mha")


def test_registry_lookup_and_unknown_name() -> None:
    from jackfield.testing.checks import resolve_backend

    assert resolve_backend("torch_ref", None) is TorchRefBackend
    with pytest.raises(KeyError, match="no attention named 'nope'"):
        resolve_backend("nope", None)
    with pytest.raises(pytest.fail.Exception, match="backend_name"):
        resolve_backend(None, None)
