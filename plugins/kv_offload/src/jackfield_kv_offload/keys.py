"""Chunk keys and which chunks of a sliding-window group are worth holding.

A chunk is `blocks_per_chunk` consecutive KV blocks of one KV cache group. Its key is the group
index and the chained hash of its last block: the hash the engine's device prefix cache uses, so
the key names the whole prefix up to the chunk's end (the engine hands the hashes over; this
package never hashes tokens itself). The chain starts from the engine's configured hash seed, so
two processes with the same seed agree on every key.

A sliding-window group needs only the last `window - 1 + retained_extra_tokens` tokens before the
point a request resumes from. Loads resume at the end of an aligned chunk (the full-attention
group's chunk, or the group's own when every group has a window), so of each aligned segment only
the window's last chunks are reachable by a future request; the rest is never stored nor loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jackfield.contracts.kv_connector import KVCoverageSpec


@dataclass(frozen=True)
class ChunkKey:
    group: int  # KV cache group index
    block_hash: int  # chained hash of the chunk's last block (names the whole prefix)
    # pd: the request whose transfer brought the chunk (its id on both engines), which alone reads
    # it; None in the CPU tier, where any request with the prefix may
    request: int | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_window_size_in_chunks(window: int, tokens_per_chunk: int, extra_retained_tokens: int) -> int:
    """Chunks a window group keeps before a resume point: the window itself, or the W - 1 tokens a
    query still sees plus the retained draft positions, whichever takes more chunks."""
    if window < 1 or tokens_per_chunk < 1 or extra_retained_tokens < 0:
        raise ValueError(f"need window >= 1, tokens_per_chunk >= 1, extra >= 0; got {window}, "
                         f"{tokens_per_chunk}, {extra_retained_tokens}")
    return max(cdiv(window, tokens_per_chunk), cdiv(window - 1 + extra_retained_tokens, tokens_per_chunk))


def chunk_keys(block_hashes: Sequence[int], group: int, blocks_per_chunk: int) -> list[ChunkKey]:
    """Keys of the full chunks among a request's full blocks (a partial chunk has no key)."""
    return [ChunkKey(group, block_hashes[end - 1])
            for end in range(blocks_per_chunk, len(block_hashes) + 1, blocks_per_chunk)]


@dataclass(frozen=True)
class GroupChunking:
    """How one KV cache group is cut into chunks, and which chunks a future request can reach.

    coverage: the group's coverage spec with `retained_extra_tokens` set to the drafters'
    combined lookahead (derived with `with_changes`: it widens what is held, never the model's
    window). aligned_tokens: tokens per resume segment (the full-attention group's chunk)."""

    coverage: KVCoverageSpec
    blocks_per_chunk: int
    aligned_tokens: int

    def __post_init__(self) -> None:
        if self.blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {self.blocks_per_chunk}")
        if self.aligned_tokens % self.tokens_per_chunk:
            raise ValueError(f"a resume segment of {self.aligned_tokens} tokens is not a whole number of "
                             f"{self.tokens_per_chunk}-token chunks")

    @property
    def tokens_per_chunk(self) -> int:
        return self.coverage.block_size * self.blocks_per_chunk

    @property
    def segment_chunks(self) -> int:
        return self.aligned_tokens // self.tokens_per_chunk

    @property
    def window_chunks(self) -> int | None:
        """Chunks held before a resume point (None: full attention, every chunk)."""
        window = self.coverage.sliding_window
        if window is None:
            return None
        extra = self.coverage.retained_extra_tokens
        return sliding_window_size_in_chunks(window, self.tokens_per_chunk, extra)

    def reachable(self, chunk: int) -> bool:
        """Whether a request resuming at some segment end can need chunk `chunk`: at offset p of
        its segment of seg_len chunks, iff p >= seg_len - window_chunks."""
        held = self.window_chunks
        return held is None or chunk % self.segment_chunks >= self.segment_chunks - held

    def needed_chunks(self, resume_segments: int) -> range:
        """Chunks a request resuming after `resume_segments` segments reads."""
        end = resume_segments * self.segment_chunks
        held = self.window_chunks
        return range(0 if held is None else max(0, end - held), end)


def group_chunkings(coverages: Sequence[KVCoverageSpec], blocks_per_chunk: Sequence[int],
                    extra_retained_tokens: int) -> list[GroupChunking]:
    """Each group's chunking; resume segments are the first full-attention group's chunk (or,
    with windows everywhere, the largest group chunk)."""
    widened = [c.with_changes(retained_extra_tokens=extra_retained_tokens) for c in coverages]
    tokens = [c.block_size * n for c, n in zip(coverages, blocks_per_chunk, strict=True)]
    full = [t for c, t in zip(coverages, tokens, strict=True) if c.sliding_window is None]
    aligned = full[0] if full else max(tokens)
    return [GroupChunking(c, n, aligned) for c, n in zip(widened, blocks_per_chunk, strict=True)]
