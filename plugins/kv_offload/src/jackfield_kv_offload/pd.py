"""pd: prefill/decode disaggregation. Two engines in two processes share one model and config:
the producer (prefill) computes prompts and exports their KV, the consumer (decode) loads it and
continues (`jackfield run --pd` starts both; docs/pd.md).

What moves is whole KV blocks of verified tokens, named by the chunk keys of the CPU tier (KV
cache group + the engine's chained block hash: both engines need one `engine.prefix_hash_seed`)
and the request's id, which both engines must give it (`jackfield run --pd` does): a landed block
serves only the request that sent it. A request with n prompt tokens resumes on the consumer after
floor(n / block_size) blocks (a load never covers the last token): full-attention groups move
all of them, window groups only the blocks the window reaches from there (`GroupChunking`). The
consumer computes the rest, at most one block.

The roles: pd_producer.py (prefill: exports) and pd_consumer.py (decode: waits for and loads what
arrived in its landing zone, landing.py); the transport: channel.py. Here: the factory, and the
start-up handshake that refuses a peer whose KV cache layout differs.
"""

from __future__ import annotations

import atexit

import torch
from jackfield.contracts.kv_connector import KVConnectorContext, KVConnectorScheduler, KVConnectorWorker

from jackfield_kv_offload.channel import Channel, GlooChannel, Kind, Sender, header
from jackfield_kv_offload.keys import group_chunkings
from jackfield_kv_offload.landing import Landing, Receiver
from jackfield_kv_offload.manager import OffloadManager
from jackfield_kv_offload.options import PREFIX, parse_pd_options
from jackfield_kv_offload.pd_consumer import PDConsumerScheduler, PDConsumerWorker
from jackfield_kv_offload.pd_producer import PDProducerScheduler, PDProducerWorker
from jackfield_kv_offload.policies import make_policy
from jackfield_kv_offload.transfer import CachePlanes, HostPool


def layout(context: KVConnectorContext, cache: CachePlanes) -> list[int]:
    """What both engines must agree on for blocks to mean the same thing, as integers."""
    out = [context.block_size, len(context.layers), len(context.coverage), context.lookahead_tokens]
    out += [c.sliding_window or 0 for c in context.coverage]
    for layer, group in enumerate(context.layer_group):
        planes = cache.of_layer(layer)
        out += [group, cache.layer_tensor[layer], len(planes)]
        out += [p.shape[1] * p.element_size() for p in planes]
    return out


def handshake(channel: Channel, producer: bool, mine: list[int]) -> None:
    """The producer sends its layout, the consumer says whether it is its own: ValueError if not."""
    if producer:
        channel.send(header(Kind.HELLO, count=len(mine)))
        channel.send(torch.tensor(mine, dtype=torch.int64))
        reply = torch.empty(4, dtype=torch.int64)
        channel.recv(reply)
        if reply[2] != 1:
            raise ValueError("the consumer's KV cache layout differs from this producer's (same model, "
                             "dtype, kv_cache_dtype, block_size and drafter on both sides?)")
        return
    hello = torch.empty(4, dtype=torch.int64)
    channel.recv(hello)
    theirs = torch.empty(int(hello[2]), dtype=torch.int64)
    channel.recv(theirs)
    same = theirs.tolist() == mine
    channel.send(header(Kind.ACK, count=int(same)))
    if not same:
        raise ValueError(f"the producer's KV cache layout {theirs.tolist()} differs from this "
                         f"consumer's {mine} (block size, layers, groups, lookahead, windows, then per "
                         "layer: group, tensor, planes, bytes per block row)")


def make_pd(context: KVConnectorContext) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """The role `options.role` names, joined to the other engine at `options.address` (ValueError:
    a bad option, no peer within connect_timeout_s, or a peer with another cache layout)."""
    options = parse_pd_options(context.options)
    producer = options.role == "producer"
    chunkings = group_chunkings(context.coverage, [1] * len(context.coverage), context.lookahead_tokens)
    cache = CachePlanes(context)
    num_slots = options.cpu_bytes // HostPool.chunk_bytes(context, 1)
    if not producer and num_slots < 1:
        raise ValueError(f"{PREFIX}.cpu_bytes ({options.cpu_bytes}) is smaller than one KV block "
                         f"({HostPool.chunk_bytes(context, 1)} bytes in every KV cache tensor)")
    try:
        channel = GlooChannel(options.address, producer, options.timeout_s, options.connect_timeout_s)
        handshake(channel, producer, layout(context, cache))
    except (ConnectionError, RuntimeError) as exc:
        raise ValueError(str(exc)) from None
    if producer:
        sender = Sender(channel, heartbeat_s=options.timeout_s / 4)
        atexit.register(sender.close)
        worker = PDProducerWorker(cache, context.layer_group, sender, context.device)
        return PDProducerScheduler(chunkings), worker
    manager = OffloadManager(num_slots, make_policy("lru", num_slots))
    pool = HostPool(context, 1, num_slots)
    landing = Landing(manager, pool, context.layer_group, len(context.coverage), hold_s=options.timeout_s)
    layouts = [[(p.shape[1], p.dtype) for p in cache.of_layer(layer)] for layer in range(len(context.layers))]
    receiver = Receiver(channel, landing, layouts)
    # Registered after the launcher's own exit handler, so it runs first: it stops the producer.
    atexit.register(receiver.join, options.timeout_s)
    return (PDConsumerScheduler(landing, chunkings, context.block_size, options.timeout_s),
            PDConsumerWorker(pool, context.layer_group, layerwise=False))
