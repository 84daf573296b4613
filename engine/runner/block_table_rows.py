"""The block tables of the running requests as rows of one persistent array.

Turning a step's block tables (Python lists) into a padded tensor costs about 4 µs
per 100 entries: 6 ms a step at 256 requests of 4k tokens, more than the device's
step. A request's table only ever grows by a block at its end in a decode, so each
request keeps a row here, brought up to date with what changed since its last step,
and a step's padded table is one fancy index over the rows. A hybrid model's
sliding-window layer groups (kvcache/hybrid.py) keep rows of their own, one
BlockTableRows a group.

A decode can change only its table's last entries (a new block, or a private copy
of the shared last block), so comparing the length and the last entry finds every
change; any step of more than one token (a prompt chunk, a verification) rewrites
the row. A request that leaves (finished, aborted, preempted: a readmission gets new
blocks) gives its row back. A sliding group's table also changes at its front (blocks
the window has passed entered as let go of): a row may keep the old ids there, which
is harmless, as the window masks those positions whatever the blocks hold."""
from __future__ import annotations

import numpy as np

from kvserve.scheduler.output import ScheduledRequest


class BlockTableRows:
    def __init__(self, rows: int = 64, width: int = 64, group: int = 0):
        # group 0: each request's block_table; g > 0: its group_tables[g - 1]
        self._group = group
        self._table = np.zeros((rows, width), dtype=np.int64)
        # request id -> [its row, entries the row holds, the last one]: Python ints,
        # so the usual decode's check reads no array
        self._rows: dict[str, list[int]] = {}
        self._free = list(range(rows - 1, -1, -1))

    def gather(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """[R, longest table] int64: each request's table, zero-padded."""
        rows, width = [], 1
        for s in scheduled:
            row, n, _ = self._sync(s)
            rows.append(row)
            width = max(width, n)
        return self._table[rows, :width]

    def drop(self, request_id: str) -> None:
        known = self._rows.pop(request_id, None)
        if known is not None:
            self._free.append(known[0])

    def _sync(self, s: ScheduledRequest) -> list[int]:
        table = s.group_tables[self._group - 1] if self._group else s.block_table
        rid = s.request.request_id
        known = self._rows.get(rid)
        if known is None:
            known = self._rows[rid] = [self._take_row(), 0, -1]
        row, n, last = known
        have = len(table)
        if s.num_new_tokens == 1 and not s.spec_token_ids and n:
            if have == n and table[-1] == last:
                return known  # the usual decode: nothing changed
            if have == n + 1 and table[-2] == last:
                self._fit(have)
                self._table[row, n] = known[2] = table[-1]  # one block appended
                known[1] = have
                return known
        self._fit(have)
        self._table[row, :have] = table
        if n > have:  # shrunk (drafts rejected): padding is zeros, as for any row
            self._table[row, have:n] = 0
        known[1], known[2] = have, (table[-1] if have else -1)
        return known

    def _take_row(self) -> int:
        if not self._free:
            old = len(self._table)
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self._table[row] = 0  # a former owner's blocks are not padding
        return row

    def _fit(self, width: int) -> None:
        if width > self._table.shape[1]:
            grown = np.zeros((len(self._table), max(width, 2 * self._table.shape[1])),
                             dtype=self._table.dtype)
            grown[:, :self._table.shape[1]] = self._table
            self._table = grown
