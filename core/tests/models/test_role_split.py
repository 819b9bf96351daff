"""The one split (jackfield.attention.metadata.GroupMetadataBuilder, per KV cache group of the
engine's StepContextBuilder): when a step's batch is divided by role, which builder builds each
half, and which impl gets each half's rows."""

from __future__ import annotations

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.attention.metadata import GroupMetadataBuilder
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionBackends, AttentionMetadata, AttentionMetadataBuilder
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.engine.sequence import Sequence
from jackfield.models.attention import RoleImpls, StepContextBuilder
from jackfield.testing.problems import make_batch, mha_layer, mla_layer

SEED = 4
MLA = mla_layer()
MHA = mha_layer()


class RecordingBuilder(AttentionMetadataBuilder):
    """Records every build: (this builder, the metadata it was handed)."""

    log: list[tuple[AttentionMetadataBuilder, AttentionMetadata]] = []

    def build(self, common: AttentionMetadata, for_capture: bool = False) -> AttentionMetadata:
        RecordingBuilder.log.append((self, common))
        return common.replace(extra={"built_by": self})


class Recording(TorchRefBackend):
    name = "recording"

    @classmethod
    def metadata_builder(cls) -> RecordingBuilder:
        return RecordingBuilder()


def _batch(num_decodes: int, num_reqs: int = 4) -> AttentionMetadata:
    gen = torch.Generator().manual_seed(SEED)
    q_lens = [1] * num_decodes + [3] * (num_reqs - num_decodes)
    return make_batch(q_lens, [q + 5 for q in q_lens], num_decodes, 4, "cpu", gen).metadata


@pytest.fixture(autouse=True)
def _fresh_log() -> None:
    RecordingBuilder.log = []


def test_mla_on_one_backend_is_divided_by_role_each_half_by_its_own_builder() -> None:
    group = GroupMetadataBuilder(Recording, Recording, [MLA, MLA])
    assert group.by_role
    decode_builder, prefill_builder = group.decode, group.prefill
    assert decode_builder is not prefill_builder  # a builder may reuse its buffers per build
    decode, prefill = group.build(_batch(num_decodes=2))
    assert (decode.role, decode.rows, decode.metadata.num_reqs, decode.metadata.num_decodes) == (
        "decode", slice(0, 2), 2, 2)
    assert (prefill.role, prefill.rows, prefill.metadata.num_reqs, prefill.metadata.num_decodes) == (
        "prefill", slice(2, None), 2, 0)
    assert decode.metadata.extra["built_by"] is decode_builder
    assert prefill.metadata.extra["built_by"] is prefill_builder
    assert [builder for builder, _ in RecordingBuilder.log] == [decode_builder, prefill_builder]


@pytest.mark.parametrize("num_decodes, role", [(4, "decode"), (0, "prefill")])
def test_a_step_of_one_role_is_built_once_unsliced(num_decodes: int, role: str) -> None:
    """Decode-only steps (the hot path, and every CUDA-graph capture) and prefill-only steps:
    one build of the step's own metadata by that role's builder, no split."""
    group = GroupMetadataBuilder(Recording, Recording, [MLA])
    common = _batch(num_decodes)
    (part,) = group.build(common, for_capture=role == "decode")
    want_builder = group.decode if role == "decode" else group.prefill
    assert part.role == role and part.rows == slice(None)
    assert RecordingBuilder.log == [(want_builder, common)]


def test_mha_on_one_backend_is_one_part_with_one_metadata() -> None:
    group = GroupMetadataBuilder(Recording, Recording, [MHA, MHA])
    assert not group.by_role and group.prefill is group.decode
    common = _batch(num_decodes=2)
    (part,) = group.build(common)
    assert part.role is None and part.rows == slice(None)
    assert RecordingBuilder.log == [(group.decode, common)]


def test_mha_on_two_backends_is_divided() -> None:
    class Other(Recording):
        name = "other"

    group = GroupMetadataBuilder(decode=Recording, prefill=Other, layers=[MHA])
    assert group.by_role
    parts = group.build(_batch(num_decodes=1))
    assert [p.role for p in parts] == ["decode", "prefill"]
    assert [type(built) for built, _ in RecordingBuilder.log] == [RecordingBuilder, RecordingBuilder]
    assert RecordingBuilder.log[0][0] is group.decode and RecordingBuilder.log[1][0] is group.prefill


def test_kv_groups_are_decided_and_read_per_group() -> None:
    """Layers read their own group's parts; each group has its own builders."""
    contexts = StepContextBuilder(AttentionBackends(Recording, Recording), [MHA, MLA, MHA], [0, 1, 0])
    full, latent = contexts.groups
    assert not full.by_role and latent.by_role and full.decode is not latent.decode
    step = contexts.build([], [_batch(2), _batch(2)])
    assert step.parts(0)[0].metadata.extra["built_by"] is full.decode
    assert [p.metadata.extra["built_by"] for p in step.parts(1)] == [latent.decode, latent.prefill]
    assert step.parts(2) == step.parts(0)
    with pytest.raises(ValueError, match="1 metadata for 2 KV cache groups"):
        contexts.build([], [_batch(2)])


def _reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_roles_on_two_backends_each_get_their_half_once_a_step(checkpoint, second_ref: str) -> None:  # type: ignore[no-untyped-def]
    """A mixed step of DeepSeek-V3 (MLA) through the runner with prefill on one backend and decode
    on another: each role's builder builds its half once, each layer's role impl gets exactly its
    half's rows once, and the step's logits equal transformers'."""
    directory, reference = checkpoint("v3")
    llm = LLM(directory, prefill_backend=second_ref, decode_backend="torch_ref", block_size=16)
    engine = llm.engine
    (group,) = engine.runner.contexts.groups
    decode_builder, prefill_builder = group.decode, group.prefill
    assert decode_builder is not prefill_builder
    builds: list[tuple[str, int, int]] = []
    calls: list[tuple[int, str, int, int]] = []
    for role, builder in (("decode", decode_builder), ("prefill", prefill_builder)):
        def build(common, for_capture=False, role=role, inner=builder.build):  # type: ignore[no-untyped-def]
            builds.append((role, common.num_reqs, common.num_decodes))
            return inner(common, for_capture)

        builder.build = build  # type: ignore[method-assign]
    layers = [m for m in engine.model.modules() if isinstance(m, RoleImpls)]
    for i, roles in enumerate(layers):
        assert roles.decode_impl is not roles.prefill_impl
        for role, impl in (("decode", roles.decode_impl), ("prefill", roles.prefill_impl)):
            def forward(q, *args, i=i, role=role, inner=impl.forward, **kwargs):  # type: ignore[no-untyped-def]
                metadata = args[3]
                calls.append((i, role, q.shape[0], metadata.num_decodes))
                return inner(q, *args, **kwargs)

            impl.forward = forward  # type: ignore[method-assign]

    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    seqs = [Sequence(i, n, torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(), 0)
            for i, n in enumerate([7, 23])]
    engine.block_manager.grow(seqs[0], 6)
    engine.runner.forward([ScheduledChunk(seqs[0], 6)])  # request 0's prompt but its last token
    seqs[0].num_computed = 6
    builds.clear()
    calls.clear()
    engine.block_manager.grow(seqs[0], 7)
    engine.block_manager.grow(seqs[1], 23)
    hidden = engine.runner.forward([ScheduledChunk(seqs[0], 1), ScheduledChunk(seqs[1], 23)])
    assert builds == [("decode", 1, 1), ("prefill", 1, 0)]
    assert calls == [c for i in range(len(layers)) for c in ((i, "decode", 1, 1), (i, "prefill", 23, 0))]
    logits = engine.model.compute_logits(hidden)
    want = torch.cat([_reference_logits(reference, seqs[0].token_ids)[-1:],
                      _reference_logits(reference, seqs[1].token_ids)])
    assert (logits - want).abs().max().item() <= 1e-4
