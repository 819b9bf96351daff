"""Every error path of the impl bases, the cache allocator and the metadata split."""

import pytest
import torch
from jackfield.attention import allocate_kv_cache, cache_shape, split_decode_prefill
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata

MLA = AttentionLayerSpec(
    num_heads=2, head_size=12, scale=0.5, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
)
MHA = AttentionLayerSpec(num_heads=4, head_size=8, scale=0.5, num_kv_heads=2)


def _md(q_lens=(1, 3), seq_lens=(4, 5), num_decodes=1) -> AttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    slots = torch.arange(int(qsl[-1]), dtype=torch.int64)
    return AttentionMetadata(qsl, seq, table, slots, qsl, seq, max(q_lens), max(seq_lens),
                             num_decodes=num_decodes, num_decode_tokens=int(qsl[num_decodes]))  # fmt: skip


def test_allocate_kv_cache_layouts_and_dtypes() -> None:
    assert allocate_kv_cache(MLA, 3, 4, torch.bfloat16, "cpu").shape == (3, 4, 12)
    mha = allocate_kv_cache(MHA, 3, 4, torch.float16, "cpu")
    assert mha.shape == (2, 3, 4, 2, 8) and mha.dtype == torch.float16
    fp8 = AttentionLayerSpec(num_heads=4, head_size=8, scale=1.0, num_kv_heads=2, kv_cache_dtype="fp8_e4m3")
    assert allocate_kv_cache(fp8, 1, 4, torch.bfloat16, "cpu").dtype == torch.float8_e4m3fn
    bf16 = AttentionLayerSpec(num_heads=4, head_size=8, scale=1.0, num_kv_heads=2, kv_cache_dtype="bfloat16")
    assert allocate_kv_cache(bf16, 1, 4, torch.float32, "cpu").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="must be positive"):
        allocate_kv_cache(MHA, 0, 4, torch.float32, "cpu")
    bad = AttentionLayerSpec(num_heads=2, head_size=11, scale=1.0, kv_lora_rank=8, qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="head_size 11"):
        cache_shape(bad, 1, 4)


def test_impl_constructors_reject_inconsistent_layers() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TorchRefBackend.make_impl(AttentionLayerSpec(num_heads=3, head_size=8, scale=1.0, num_kv_heads=2))
    with pytest.raises(ValueError, match="positive"):
        TorchRefBackend.make_impl(
            AttentionLayerSpec(num_heads=2, head_size=12, scale=1.0, kv_lora_rank=8, qk_rope_head_dim=4)
        )
    with pytest.raises(ValueError, match="must be kv_lora_rank"):
        TorchRefBackend.make_impl(
            AttentionLayerSpec(
                num_heads=2,
                head_size=10,
                scale=1.0,
                kv_lora_rank=8,
                qk_nope_head_dim=4,
                qk_rope_head_dim=4,
                v_head_dim=4,
            )
        )


def test_mla_weights_are_checked_and_required() -> None:
    impl = TorchRefBackend.make_impl(MLA)
    with pytest.raises(KeyError, match="kv_b_proj"):
        impl.process_weights_after_loading({"q_proj": torch.randn(2, 2)})
    with pytest.raises(ValueError, match=r"kv_b_proj must be \[16, 8\]"):
        impl.process_weights_after_loading({"kv_b_proj": torch.randn(8, 16)})
    cache = allocate_kv_cache(MLA, 4, 4, torch.float32, "cpu")
    for role in (_md(num_decodes=0), _md((1, 1), num_decodes=2)):  # prefill (expanded), decode (absorbed)
        t = role.num_tokens
        with pytest.raises(RuntimeError, match="process_weights_after_loading"):
            impl.forward(torch.randn(t, 2, 8), torch.randn(t, 8), torch.randn(t, 4), cache, role)
    impl.process_weights_after_loading({"kv_b_proj": torch.randn(16, 8)})
    with pytest.raises(ValueError, match=r"q must be \[T, 2, 8\]"):
        impl.forward(torch.randn(4, 2, 12), torch.randn(4, 8), torch.randn(4, 4), cache, _md())


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_mla_forward_refuses_decodes_and_prefills_together(sparse: bool) -> None:
    """The engine divides an MLA batch by role; MLAImpl.forward serves one role and says so,
    before it writes any KV."""
    impl = TorchRefBackend.make_impl(MLA)
    gen = torch.Generator().manual_seed(0)
    impl.process_weights_after_loading({"kv_b_proj": torch.randn(16, 8, generator=gen)})
    cache = allocate_kv_cache(MLA, 4, 2, torch.float32, "cpu").normal_(generator=gen)
    before = cache.clone()
    topk = {"topk_indices": torch.zeros(4, 2, dtype=torch.int32)} if sparse else {}
    with pytest.raises(ValueError, match="one role's rows; got 1 decodes among 2 requests"):
        impl.forward(torch.randn(4, 2, 8, generator=gen), torch.randn(4, 8, generator=gen),
                     torch.randn(4, 4, generator=gen), cache, _md(), **topk)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("layer", [MLA, MHA], ids=["mla", "mha"])
def test_write_kv_rejects_bad_input(layer: AttentionLayerSpec) -> None:
    impl = TorchRefBackend.make_impl(layer)
    cache = allocate_kv_cache(layer, 4, 2, torch.float32, "cpu")
    mla = layer.kv_lora_rank > 0
    key = torch.randn(3, 8) if mla else torch.randn(3, 2, 8)
    value = torch.randn(3, 4) if mla else torch.randn(3, 2, 8)
    slots = torch.tensor([0, -1, 7])
    impl.write_kv(cache, slots, key, value)  # the valid call, for contrast
    cases = [
        ((cache, slots, key.double(), value), "dtype torch.float64"),
        ((cache, slots, key[:2], value), "must be"),
        ((cache, slots, key, value[:, :1]), "must be"),
        ((cache, slots.int(), key, value), "slot_mapping must be int64"),
        ((cache, torch.tensor([0, 1, 8]), key, value), "slot 8 is out of range"),
        ((cache.transpose(-1, -2).contiguous().transpose(-1, -2), slots, key, value), "contiguous"),
        ((cache[..., :-1], slots, key, value), "cache must be"),
        ((cache.double(), slots, key, value), "not a float or fp8"),
        ((cache, slots, key.to("meta"), value), "is on meta"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            impl.write_kv(*args)


def test_write_kv_reads_a_mappings_range_again_after_it_changes() -> None:
    """The range (and padding) of a slot_mapping is read once per tensor and version: a mapping
    changed in place is checked again, its padding rows skipped, an out-of-range slot refused."""
    impl = TorchRefBackend.make_impl(MHA)
    cache = allocate_kv_cache(MHA, 4, 2, torch.float32, "cpu")
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([0, 1, 7])
    impl.write_kv(cache, slots, key, value)
    impl.write_kv(cache, slots, key, value)  # remembered
    keys, values = cache[0].flatten(0, 1), cache[1].flatten(0, 1)
    assert torch.equal(keys[slots], key) and torch.equal(values[slots], value)
    slots[1] = -1  # now a padding row: skipped, not written to the last slot
    cache.zero_()
    impl.write_kv(cache, slots, key, value)
    assert torch.equal(keys[[0, 7]], key[[0, 2]]) and not keys[1:7].any()
    slots[1] = 8
    with pytest.raises(ValueError, match="slot 8 is out of range"):
        impl.write_kv(cache, slots, key, value)


@pytest.mark.parametrize("layer", [MLA, MHA], ids=["mla", "mha"])
def test_fp8_cache_requires_a_float32_scale(layer: AttentionLayerSpec) -> None:
    fp8 = AttentionLayerSpec(**{**layer.__dict__, "kv_cache_dtype": "fp8_e4m3"})
    impl = TorchRefBackend.make_impl(fp8)
    cache = allocate_kv_cache(fp8, 4, 2, torch.float32, "cpu")
    mla = layer.kv_lora_rank > 0
    key = torch.randn(1, 8) if mla else torch.randn(1, 2, 8)
    value = torch.randn(1, 4) if mla else torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="needs kv_scale"):
        impl.write_kv(cache, torch.tensor([0]), key, value)
    # MLA takes one scale (its record), MHA two (key, value)
    wrong_size = torch.tensor([0.1, 0.2]) if mla else torch.tensor([0.1])
    with pytest.raises(ValueError, match=f"{1 if mla else 2}-element float32"):
        impl.write_kv(cache, torch.tensor([0]), key, value, wrong_size)
    q = torch.randn(1, layer.num_heads, 12 if mla else 8)
    md = _md((1,), (1,), 1).replace(block_table=torch.tensor([[0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="needs kv_scale"):
        impl.attend(q, cache, md)
    with pytest.raises(ValueError, match="configured fp8_e4m3"):
        impl.write_kv(allocate_kv_cache(layer, 4, 2, torch.float32, "cpu"), torch.tensor([0]), key, value)


def test_attend_rejects_bad_input() -> None:
    impl = TorchRefBackend.make_impl(MHA)
    cache = allocate_kv_cache(MHA, 4, 4, torch.float32, "cpu")
    md, q = _md(), torch.randn(4, 4, 8)
    impl.attend(q, cache, md)  # valid
    cases = [
        (dict(query=q.double()), "query dtype"),
        (dict(query=q[:, :3]), r"query must be \[T, 4, 8\]"),
        (dict(query=q[:3]), "does not describe 3 query rows"),
        (dict(metadata=_md((1, 3), (4, 2))), "query lengths"),
        (dict(metadata=md.replace(block_table=md.block_table[:1])), "block_table must be"),
        (dict(metadata=md.replace(block_table=md.block_table[:, :1])), "too few for seq_len 5"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks must be float32"),
        (dict(topk_indices=torch.zeros(4, 2, dtype=torch.int64)), "topk_indices must be int32"),
        (dict(topk_indices=torch.full((4, 2), 5, dtype=torch.int32)), r"topk_indices must be in \[-1"),
    ]
    for change, match in cases:
        kwargs = dict(query=q, kv_cache=cache, metadata=md) | change
        with pytest.raises(ValueError, match=match):
            impl.attend(**kwargs)


def test_attend_reads_the_metadata_again_after_it_changes() -> None:
    """The step's layout is checked once per metadata and version of its host tensors (every layer
    shares it): attending again is not checked again, but a change in place is, and so is the same
    metadata against a query of other rows or a cache of other blocks."""
    impl = TorchRefBackend.make_impl(MHA)
    cache = allocate_kv_cache(MHA, 4, 4, torch.float32, "cpu")
    md, q = _md(), torch.randn(4, 4, 8)
    impl.attend(q, cache, md)
    impl.attend(q, cache, md)
    with pytest.raises(ValueError, match="too few for seq_len 5"):
        impl.attend(q, allocate_kv_cache(MHA, 8, 2, torch.float32, "cpu"), md)
    md.seq_lens_cpu[0] = 0  # request 0 now has fewer keys than query rows
    with pytest.raises(ValueError, match="query lengths"):
        impl.attend(q, cache, md)


def test_split_decode_prefill() -> None:
    md = _md((1, 2, 3), (4, 5, 6), num_decodes=2).replace(
        block_table=torch.arange(6, dtype=torch.int32).view(3, 2)
    )
    decode, prefill = split_decode_prefill(md)
    assert decode.query_start_loc_cpu.tolist() == [0, 1, 3] and decode.num_decode_tokens == 3
    assert decode.slot_mapping.tolist() == [0, 1, 2] and decode.max_seq_len == 5
    assert prefill.query_start_loc.tolist() == [0, 3] and prefill.slot_mapping.tolist() == [3, 4, 5]
    assert (
        prefill.block_table.tolist() == [[4, 5]] and prefill.num_decodes == 0 and prefill.max_query_len == 3
    )
    assert decode.extra is not prefill.extra and decode.extra is not md.extra  # each half's own
    assert split_decode_prefill(md.replace(num_decodes=0, num_decode_tokens=0))[0] is None
    assert split_decode_prefill(md.replace(num_decodes=3, num_decode_tokens=6))[1] is None
    with pytest.raises(ValueError, match="disagree"):
        split_decode_prefill(md.replace(num_decode_tokens=2))
