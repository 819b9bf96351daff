"""Both sides of a pd transfer without engines: random caches, hand-made requests. The tests import
it (the consumer side) and run it as a script (the producer, in a process of its own):

    python pd_side.py KIND ADDRESS SEED [DIE_AFTER_LAYERS]

KIND is "mla" (bf16, one group) or "mha" (float32, a full group and a window group sharing two
cache tensors). With DIE_AFTER_LAYERS the producer kills itself (no goodbye) once it has sent
that many layer messages, in the middle of the transfer. `run_prefill_then_die` does the same
to a whole prefill engine (`PDLLM`'s child, which imports it from here).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from jackfield.attention.kv_cache import allocate_kv_cache, is_mla
from jackfield.contracts.attention import AttentionLayerSpec
from jackfield.contracts.kv_connector import (
    ConnectorRequest,
    KVConnectorContext,
    KVCoverageSpec,
    ScheduledRequest,
)

BLOCK, NUM_BLOCKS, WINDOW = 4, 16, 6
PROMPT = 23  # tokens: 5 whole blocks; the consumer resumes at token 20
REQUEST = "7"  # the request's id, the same on both engines
MLA = AttentionLayerSpec(num_heads=4, head_size=40, scale=0.1, kv_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16)
MHA = AttentionLayerSpec(num_heads=4, head_size=8, scale=0.1, num_kv_heads=2)


def context(kind: str, role: str, address: str, seed: int, timeout_s: float = 5.0) -> KVConnectorContext:
    """The layout of `kind`, caches filled with random bytes drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    layer, dtype, windows = (MLA, torch.bfloat16, (None,)) if kind == "mla" else (MHA, torch.float32,
                                                                                   (None, WINDOW))
    tensors = [allocate_kv_cache(layer, NUM_BLOCKS, BLOCK, dtype, "cpu") for _ in range(2)]
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    groups = len(windows)
    options = {"role": role, "address": address, "timeout_s": timeout_s, "connect_timeout_s": 60,
               "cpu_bytes": 1 << 20}
    return KVConnectorContext(options=options, block_size=BLOCK,
                              coverage=tuple(KVCoverageSpec(BLOCK, w) for w in windows), lookahead_tokens=0,
                              layers=(layer,) * (2 * groups),
                              layer_group=tuple(g for g in range(groups) for _ in (0, 1)),
                              kv_caches=tuple(tensors[j] for _ in range(groups) for j in (0, 1)),
                              device=torch.device("cpu"))


def block_bytes(ctx: KVConnectorContext, layer: int, block: int,
                cache: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of `block` in `layer`'s cache (or in `cache`, a tensor of that layout)."""
    raw = (ctx.kv_caches[layer] if cache is None else cache).view(torch.uint8)
    return (raw[block] if is_mla(ctx.layers[layer]) else raw[:, block]).clone()


def hashes(seed: int) -> tuple[int, ...]:
    """The request's chained block hashes (any int64s: the connector never hashes tokens)."""
    g = torch.Generator().manual_seed(seed + 1)
    return tuple(torch.randint(-2**62, 2**62, (PROMPT // BLOCK + 1,), generator=g).tolist())


def producer_tables(groups: int) -> tuple[tuple[int, ...], ...]:
    """The prefill's block table per group: 6 blocks for 23 tokens, groups on disjoint blocks."""
    return tuple(tuple(range(1 + 6 * g, 7 + 6 * g)) for g in range(groups))


def produce(kind: str, address: str, seed: int, die_after: int | None) -> None:
    from jackfield_kv_offload import channel
    from jackfield_kv_offload.pd import make_pd

    if die_after is not None:  # the producer dies in the middle of its transfer
        real_send, sent = channel.Sender._send, [0]

        def send_then_die(self: channel.Sender, message: channel.Outgoing) -> None:
            if message.kind == channel.Kind.LAYER:
                if sent[0] == die_after:
                    os._exit(3)
                sent[0] += 1
            real_send(self, message)

        channel.Sender._send = send_then_die  # type: ignore[method-assign]
    ctx = context(kind, "producer", address, seed)
    scheduler, worker = make_pd(ctx)
    request = ConnectorRequest(REQUEST, hashes(seed)[: PROMPT // BLOCK], PROMPT)
    tables = producer_tables(len(ctx.coverage))
    scheduler.update_state_after_alloc(request, tables, 0, 0)
    metadata = scheduler.build_connector_meta([ScheduledRequest(request, tables, PROMPT)])
    worker.start_load_kv(metadata, ctx.kv_caches)
    for layer in range(len(ctx.layers)):
        worker.save_kv_layer(layer, ctx.kv_caches[layer], metadata)
    worker.wait_for_save()
    deadline = time.monotonic() + 30
    while REQUEST not in worker.get_finished().saved:
        if time.monotonic() > deadline:
            sys.exit("the consumer never took the transfer")
        time.sleep(0.01)
    time.sleep(1.0)  # leave the stream open while the consumer reads its last message


if __name__ == "__main__":
    produce(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)


def run_prefill_then_die(config: object, pipe: object) -> None:
    """`jackfield.commands.pd.run_prefill_engine`, killed (no goodbye) once its connector has sent
    $PD_TEST_DIE_AFTER layer messages: a prefill engine dying in the middle of a transfer."""
    from jackfield.commands.pd import run_prefill_engine
    from jackfield_kv_offload import channel

    die_after, real_send, sent = int(os.environ["PD_TEST_DIE_AFTER"]), channel.Sender._send, [0]

    def send_then_die(self: channel.Sender, message: channel.Outgoing) -> None:
        if message.kind == channel.Kind.LAYER:
            if sent[0] == die_after:
                os._exit(3)
            sent[0] += 1
        real_send(self, message)

    channel.Sender._send = send_then_die  # type: ignore[method-assign]
    run_prefill_engine(config, pipe)  # type: ignore[arg-type]
