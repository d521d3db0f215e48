"""Persistent block tables: every request's block table of every KV cache group as one numpy array, kept across steps.

The manager owns the truth (each request's ``Page`` lists, refcounts); this array mirrors it as page ids and is
what a step reads: ``gather`` copies the rows of the step's sequences into the ``[G, S, width]`` table the runner
hands the device, one vectorized copy instead of a walk over every request's tables every step.

Each running request holds one row (``new_row`` at admit or fork, ``free_row`` when it leaves). The manager writes
only what changes, where it changes: the pages a step appends (every group's at once), a window group's dropped
blocks (set to the null page 0), a copy-on-write replacement, the draft slots a rollback gives back. A free row is
all zeros, so a row handed out again starts as an empty table; entries past a table's length are zero too, which
is the null page the padding of a step's table must hold.

The array grows (rows and width doubling, contents kept) when a request needs more rows or blocks than it has.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_jax.kv_cache.page_pool import NULL_PAGE


class BlockTables:
    """``array[g, row, i]``: the page of logical block ``i`` of the request holding ``row``, in group ``g``."""

    __slots__ = ("array", "lengths", "_free_rows")

    def __init__(self, num_groups: int, rows: int = 8, width: int = 16) -> None:
        self.array = np.zeros((num_groups, rows, width), np.int32)  # [G, rows, width] i32
        self.lengths = np.zeros(rows, np.int32)  # [rows] i32: blocks in each row's tables (every group alike)
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest row first

    @property
    def width(self) -> int:
        return self.array.shape[2]

    def new_row(self) -> int:
        """A row for a request starting to hold pages (all zeros)."""
        if not self._free_rows:
            g, rows, width = self.array.shape
            grown = np.zeros((g, 2 * rows, width), np.int32)
            grown[:, :rows] = self.array
            self.array = grown
            self.lengths = np.concatenate([self.lengths, np.zeros(rows, np.int32)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        """Return a row; it is zeroed for its next holder."""
        self.array[:, row, : self.lengths[row]] = NULL_PAGE
        self.lengths[row] = 0
        self._free_rows.append(row)

    def reserve(self, num_blocks: int) -> None:
        """Make every row at least ``num_blocks`` wide."""
        g, rows, width = self.array.shape
        if num_blocks <= width:
            return
        while width < num_blocks:
            width *= 2
        grown = np.zeros((g, rows, width), np.int32)
        grown[:, :, : self.array.shape[2]] = self.array
        self.array = grown

    def gather(self, rows: Sequence[int]) -> np.ndarray:
        """The block tables of ``rows`` in order, ``[G, len(rows), width]`` int32 (a copy; ``width``: the longest of
        their tables)."""
        index = np.asarray(rows, np.intp)
        width = int(self.lengths[index].max()) if len(rows) else 0
        return self.array[:, index, :width]


__all__ = ["BlockTables"]
