"""A hybrid model's recurrent state on the device: the slot pool and each step's metadata.

The pool holds, per recurrent layer, one conv window and one recurrence state per slot: one per
running request (`max_num_seqs`; the block manager hands them out with the request's blocks:
`BlockManager(num_state_slots=...)`) and one more, which the padded rows of a replayed decode
step (engine/cuda_graphs.py) read and write. A request whose num_computed
is 0 (a first admission, or a preempted request being recomputed) starts from a zero state;
any other chunk continues from its slot.

Speculative verify chunks keep the state after each of their rows; once the step's tokens are
verified, `roll_back` puts the state after the last accepted row into the slot (the ops left the
state after the last draft there).
"""

from __future__ import annotations

import torch

from jackfield.contracts.recurrent import RecurrentMetadata, RecurrentStateSpec, RecurrentStep
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.models.hybrid import allocate_recurrent_states
from jackfield.ops.recurrent import recurrent_metadata


class RecurrentStates:
    def __init__(self, specs: list[RecurrentStateSpec], num_slots: int, device: torch.device) -> None:
        problems = [p for spec in specs for p in spec.problems()]
        if problems:
            raise ValueError("recurrent layers the engine cannot keep: " + "; ".join(problems))
        self.num_slots, self.device = num_slots, device
        self.conv, self.states = allocate_recurrent_states(specs, num_slots, device)
        self.conv_kernels = frozenset(spec.conv_kernel for spec in specs)

    @property
    def padding_slot(self) -> int:
        """The slot no request holds (the last): padded rows of a replayed decode step use it."""
        return self.num_slots - 1

    def decode_step(self, slots: torch.Tensor, has_state: torch.Tensor) -> RecurrentStep:
        """A decode step of len(slots) rows over static buffers (CUDA graphs): each row one
        request, its slot and whether it has a state read from `slots` and `has_state`, which the
        caller rewrites in place before each replay."""
        size, device = slots.shape[0], slots.device
        rows = torch.arange(size, device=device)
        metadata = RecurrentMetadata(
            query_start_loc=torch.arange(size + 1, device=device), query_lens=torch.ones_like(rows),
            state_slots=slots, has_state=has_state, padded_rows=rows[:, None],
            valid_rows=rows,
            conv_windows={k: torch.arange(1, k, device=device).expand(size, -1) for k in self.conv_kernels},
            keep_requests=rows[:0], num_tokens=size, max_query_len=1)
        return RecurrentStep(metadata, self.conv, self.states)

    def step(self, chunks: list[ScheduledChunk]) -> RecurrentStep:
        """The step's recurrent part, built once for every recurrent layer (chunks: decodes first)."""
        slots = []
        for chunk in chunks:
            if chunk.seq.state_slot is None:
                raise RuntimeError(f"request {chunk.seq.request_id} runs without a recurrent state slot")
            slots.append(chunk.seq.state_slot)
        if max(slots) >= self.num_slots:  # on the host: the ops check slots only on the CPU
            raise ValueError(f"state slot {max(slots)} is outside the pool of {self.num_slots} slots")
        metadata = recurrent_metadata(
            [c.num_tokens for c in chunks], slots, [c.seq.num_computed > 0 for c in chunks],
            [i for i, c in enumerate(chunks) if c.num_drafts], self.conv_kernels, self.device)
        return RecurrentStep(metadata, self.conv, self.states)

    def roll_back(self, step: RecurrentStep, chunks: list[ScheduledChunk], accepted: list[int]) -> None:
        """Per kept (verify) chunk, in order, the state after its row `accepted` (its known row and
        that many accepted drafts) goes into its slot."""
        kept = step.metadata.keep_requests.tolist()
        if len(kept) != len(accepted):
            raise ValueError(f"{len(accepted)} accepted counts for {len(kept)} verify chunks")
        rows = [(v, a, chunks[i].seq.state_slot) for v, (i, a) in enumerate(zip(kept, accepted, strict=True))
                if a < chunks[i].num_drafts]  # all accepted: the slot holds the right state already
        if not rows:
            return
        index = torch.tensor([v for v, _, _ in rows], device=self.device)
        row = torch.tensor([a for _, a, _ in rows], device=self.device)
        slots = torch.tensor([s for _, _, s in rows], device=self.device)
        for layer in range(len(self.states)):
            self.conv[layer][slots] = step.rows.conv[layer][index, row]
            self.states[layer][slots] = step.rows.state[layer][index, row]
