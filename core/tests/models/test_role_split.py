"""The one split (jackfield.models.attention.StepContextBuilder): when a step's batch is divided by
role, which builder builds each half, and which impl gets each half's rows."""

from __future__ import annotations

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionMetadata, AttentionMetadataBuilder
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.engine.sequence import Sequence
from jackfield.models.attention import AttentionBackends, RoleImpls, StepContextBuilder
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
    contexts = StepContextBuilder(AttentionBackends(Recording, Recording), [MLA, MLA], [0, 0])
    assert contexts.by_role == [True]
    decode_builder, prefill_builder = contexts.builders[0]
    assert decode_builder is not prefill_builder  # a builder may reuse its buffers per build
    common = _batch(num_decodes=2)
    decode, prefill = contexts.build([], [common]).parts(1)
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
    contexts = StepContextBuilder(AttentionBackends(Recording, Recording), [MLA], [0])
    common = _batch(num_decodes)
    (part,) = contexts.build([], [common], for_capture=role == "decode").parts(0)
    want_builder = contexts.builders[0][0 if role == "decode" else 1]
    assert part.role == role and part.rows == slice(None)
    assert RecordingBuilder.log == [(want_builder, common)]


def test_mha_on_one_backend_is_one_part_with_one_metadata() -> None:
    contexts = StepContextBuilder(AttentionBackends(Recording, Recording), [MHA, MHA], [0, 0])
    assert contexts.by_role == [False]
    common = _batch(num_decodes=2)
    (part,) = contexts.build([], [common]).parts(0)
    assert part.role is None and part.rows == slice(None)
    assert RecordingBuilder.log == [(contexts.builders[0][0], common)]


def test_mha_on_two_backends_is_divided() -> None:
    class Other(Recording):
        name = "other"

    contexts = StepContextBuilder(AttentionBackends(prefill=Other, decode=Recording), [MHA], [0])
    assert contexts.by_role == [True]
    parts = contexts.build([], [_batch(num_decodes=1)]).parts(0)
    assert [p.role for p in parts] == ["decode", "prefill"]


def test_kv_groups_are_decided_and_read_per_group() -> None:
    """Layers read their own group's parts; each group has its own builders."""
    contexts = StepContextBuilder(AttentionBackends(Recording, Recording), [MHA, MHA, MHA], [0, 1, 0])
    assert contexts.by_role == [False, False] and contexts.builders[0][0] is not contexts.builders[1][0]
    first, second = _batch(2), _batch(2)
    step = contexts.build([], [first, second])
    assert step.parts(0)[0].metadata.extra["built_by"] is contexts.builders[0][0]
    assert step.parts(1)[0].metadata.extra["built_by"] is contexts.builders[1][0]
    assert step.parts(2) == step.parts(0)


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
    decode_builder, prefill_builder = engine.runner.contexts.builders[0]
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
