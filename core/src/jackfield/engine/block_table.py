"""Every request's block tables as rows of one host array, for building a step's inputs.

The block manager's per-request lists (`Sequence.block_tables`) are what the scheduler, the
prefix cache and KV connectors read. `BlockTableRows` mirrors them in a [groups, rows, width]
int32 host tensor, written where the lists change (blocks appended, window blocks dropped, a
request admitted or released), so a step gathers its requests' tables with one indexing op and
computes slots vectorized, instead of converting Python lists every step (vLLM keeps its block
tables the same way).

A request holds one row (`Sequence.table_row`) from admission to release; freed rows are reused.
All of a request's tables have one length (they grow to the same block count; a dropped window
block stays in place as the null block), kept per row. Entries past a row's length are 0, as
the padding of the lists was. Rows and width double when they run out.
"""

from __future__ import annotations

import numpy as np
import torch


def slots_at(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The KV slot of each of `positions` [n, ...] in its request's block table (`table` [n,
    width], one group's). A position past the request's blocks (a padding or dead row, whose slot
    the caller masks to -1) or below 0 reads a clipped block: its value is meaningless, not an
    index error."""
    index = np.clip(positions // block_size, 0, table.shape[1] - 1)
    requests = np.arange(table.shape[0]).reshape((-1,) + (1,) * (positions.ndim - 1))
    return table.astype(np.int64)[requests, index] * block_size + positions % block_size


class BlockTableRows:
    def __init__(self, num_groups: int, rows: int = 16, width: int = 16) -> None:
        self.array = torch.zeros(num_groups, max(rows, 1), max(width, 1), dtype=torch.int32)
        self.lengths = [0] * self.array.shape[1]
        self.free_rows = list(range(self.array.shape[1] - 1, -1, -1))  # popped from the end: row 0 first

    def take_row(self) -> int:
        if not self.free_rows:
            rows = self.array.shape[1]
            self.array = torch.cat([self.array, torch.zeros_like(self.array)], dim=1)
            self.lengths += [0] * rows
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def free_row(self, row: int) -> None:
        self.array[:, row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self.free_rows.append(row)

    def extend(self, row: int, tables: list[list[int]]) -> None:
        """Append each group's entries of `tables` past the row's length (the lists grew)."""
        start, end = self.lengths[row], len(tables[0])
        if end <= start:
            return
        width = self.array.shape[2]
        if end > width:
            while width < end:
                width *= 2
            grown = torch.zeros(self.array.shape[0], self.array.shape[1], width, dtype=torch.int32)
            grown[:, :, : self.array.shape[2]] = self.array
            self.array = grown
        new = [table[start:end] for table in tables]
        self.array[:, row, start:end] = torch.tensor(new, dtype=torch.int32)
        self.lengths[row] = end

    def clear(self, row: int, group: int, start: int, end: int) -> None:
        """Entries start..end - 1 of one group's table became the null block (0)."""
        self.array[group, row, start:end] = 0

    def gather_array(self, rows: list[int]) -> np.ndarray:
        """[groups, len(rows), longest of those tables] int32: the rows' tables, 0-padded, as a
        numpy array (a copy; host index arithmetic without torch's per-op dispatch)."""
        width = max(map(self.lengths.__getitem__, rows), default=0)
        return self.array.numpy()[:, rows, :width]

    def gather(self, rows: list[int]) -> torch.Tensor:
        """`gather_array` as a tensor (sharing its memory)."""
        return torch.from_numpy(self.gather_array(rows))
