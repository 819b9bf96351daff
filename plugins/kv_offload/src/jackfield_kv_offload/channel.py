"""The pd connector's transport: one ordered stream of messages from the producer (prefill) to the
consumer (decode), over a two-rank gloo process group of its own (rank 0 the producer; the
consumer hosts the rendezvous store at `address`).

A message is a header (int64[HEADER]: kind, transfer id, count, layer) and the tensors it
announces, each received into a buffer the consumer sizes from the header and its own copy of
the cache layout. Gloo gives no usable poll (a receive completes only inside `wait`), and a wait
that times out closes the pair for good. So the consumer receives on a thread of its own, the
producer sends from a thread of its own (`Sender`, in order) and sends a heartbeat whenever it
has been quiet for a quarter of the timeout; a receive that times out means the producer is gone.
A producer that stops says BYE, and both threads are ended at exit (`atexit`): a thread still
blocked in gloo when the interpreter finalizes aborts the process once its wait returns.

Another transport (NCCL between GPUs, shared memory on one host) implements `Channel`.
"""

from __future__ import annotations

import enum
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER = 4  # kind, transfer id, count, layer


class Kind(enum.IntEnum):
    HELLO = 1  # producer -> consumer: its cache layout (count int64s follow)
    ACK = 2  # consumer -> producer: count = 1 when the layouts match, else 0
    BEGIN = 3  # a transfer's chunks: int64[count, 3] follows: (group, chained hash, request id)
    LAYER = 4  # one KV cache layer's rows for the transfer's chunks of its group: one tensor per plane
    END = 5  # the transfer is whole: its chunks may be read
    HEARTBEAT = 6
    BYE = 7  # the producer stops: the stream ends here


def header(kind: Kind, transfer: int = 0, count: int = 0, layer: int = 0) -> torch.Tensor:
    return torch.tensor([int(kind), transfer, count, layer], dtype=torch.int64)


class Channel(ABC):
    """A point-to-point stream of CPU tensors in order; every wait bounded by the timeout."""

    @abstractmethod
    def send(self, tensor: torch.Tensor) -> None:
        """Blocks until `tensor` is handed to the transport (RuntimeError: the peer is gone)."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor) -> None:
        """Fills `tensor` with the next message's bytes (RuntimeError: timed out or the peer is gone)."""


class GlooChannel(Channel):
    def __init__(self, address: str, producer: bool, timeout_s: float, connect_timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), 2, is_master=not producer,
                                  timeout=timedelta(seconds=connect_timeout_s))
            self.group = dist.ProcessGroupGloo(store, 0 if producer else 1, 2, timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError) as exc:  # DistStoreError: the peer never came
            peer = "consumer" if producer else "producer"
            raise ConnectionError(f"pd: no {peer} joined at {address} within {connect_timeout_s} s "
                                  f"({str(exc).splitlines()[0]})") from None
        self.peer = 1 if producer else 0

    def send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor], self.peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self.group.recv([tensor], self.peer, 0).wait()


@dataclass
class Outgoing:
    """One message for the sender thread. `ready`: a CUDA event after which `tensors` (device
    rows just gathered on the compute stream) may be read; None on the CPU."""

    kind: Kind
    transfer: int = 0
    count: int = 0  # HELLO: int64s; BEGIN: chunks; LAYER: rows of each tensor
    layer: int = 0
    tensors: Sequence[torch.Tensor] = field(default_factory=tuple)
    ready: torch.cuda.Event | None = None


class Sender:
    """Sends queued messages in order on a thread of its own, a heartbeat when idle. A failed send
    stops it: every transfer not yet ended is reported failed, with the reason in `error`."""

    def __init__(self, channel: Channel, heartbeat_s: float) -> None:
        self.channel, self.heartbeat_s = channel, heartbeat_s
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.lock = threading.Lock()
        self.ended: set[int] = set()  # transfers whose END was sent, not yet reported
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="jackfield-pd-sender", daemon=True)
        self.thread.start()

    def put(self, message: Outgoing) -> None:
        self.queue.put(message)

    def close(self) -> None:
        """Send what is queued, then BYE (bounded: a consumer that takes nothing times it out)."""
        self.queue.put(None)
        self.thread.join(timeout=self.heartbeat_s * 4)

    def take_ended(self) -> set[int]:
        with self.lock:
            ended, self.ended = self.ended, set()
        return ended

    def _run(self) -> None:
        while True:
            try:
                message = self.queue.get(timeout=self.heartbeat_s)
            except queue.Empty:
                message = Outgoing(Kind.HEARTBEAT)
            try:
                if message is None:
                    self._send(Outgoing(Kind.BYE))
                    return
                self._send(message)
            except RuntimeError as exc:
                self.error = f"pd: sending to the consumer failed: {str(exc).splitlines()[0]}"
                return
            if message.kind == Kind.END:
                with self.lock:
                    self.ended.add(message.transfer)

    def _send(self, message: Outgoing) -> None:
        if message.ready is not None:
            message.ready.synchronize()
        self.channel.send(header(message.kind, message.transfer, message.count, message.layer))
        for tensor in message.tensors:
            self.channel.send(tensor.cpu() if tensor.device.type != "cpu" else tensor)
