"""In what order do waiting sequences get admitted? Round-robin between groups, so one client request cannot
take the whole queue.

A group is one client request: the prompts of a multi-prompt API request (an OpenAI completions `prompt` list)
share one; every other request is a group of its own. New sequences join their group's deque; groups take turns,
one sequence per turn, in the order they first arrived (a group that empties leaves the rotation, one that gets
a new sequence later rejoins at the back). With one sequence per group this is plain arrival order; four
64-prompt requests followed by a one-prompt request put that prompt fifth in line, not 257th.

Sequences put back at the front (preempted ones, to be recomputed, and ones passed over while their LoRA adapter
had no device slot) wait in a front deque that is served before every group, in its own order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

from paged_jax.sched.sequence import TokenSequence


class WaitingQueue:
    """The scheduler's waiting sequences (the deque operations it uses: `append` with a group, `appendleft`,
    `extendleft`, `popleft`, `[0]`, `remove`, `len`, `in`, iteration in admission order)."""

    def __init__(self) -> None:
        self._front: deque[TokenSequence] = deque()  # served first, in order
        # Groups in turn order; the first key's deque supplies the next sequence, then that group goes last.
        self._groups: OrderedDict[str, deque[TokenSequence]] = OrderedDict()
        self._group_of: dict[str, str] = {}  # seq_id -> group key, for the sequences in a group's deque

    def append(self, seq: TokenSequence, group: str) -> None:
        """Queue a new sequence in `group` (a group that is not in the rotation joins it at the back)."""
        q = self._groups.get(group)
        if q is None:
            q = self._groups[group] = deque()
        q.append(seq)
        self._group_of[seq.seq_id] = group

    def appendleft(self, seq: TokenSequence) -> None:
        """Put `seq` at the very front (it goes before every group)."""
        self._front.appendleft(seq)

    def extendleft(self, seqs: Iterable[TokenSequence]) -> None:
        self._front.extendleft(seqs)

    def __getitem__(self, i: int) -> TokenSequence:
        if i != 0:
            raise IndexError("WaitingQueue: only the head ([0]) is addressable")
        if self._front:
            return self._front[0]
        if not self._groups:
            raise IndexError("WaitingQueue: empty")
        return next(iter(self._groups.values()))[0]

    def popleft(self) -> TokenSequence:
        """The head: the front deque's first, else the next group's first (that group then goes to the back)."""
        if self._front:
            return self._front.popleft()
        if not self._groups:
            raise IndexError("WaitingQueue: empty")
        group, q = next(iter(self._groups.items()))
        seq = q.popleft()
        del self._group_of[seq.seq_id]
        if q:
            self._groups.move_to_end(group)
        else:
            del self._groups[group]
        return seq

    def remove(self, seq: TokenSequence) -> None:
        group = self._group_of.pop(seq.seq_id, None)
        if group is None:
            self._front.remove(seq)
            return
        q = self._groups[group]
        q.remove(seq)
        if not q:
            del self._groups[group]

    def __len__(self) -> int:
        return len(self._front) + len(self._group_of)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._groups)

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, TokenSequence):
            return False
        group = self._group_of.get(seq.seq_id)
        return seq in self._front if group is None else seq in self._groups[group]

    def __iter__(self) -> Iterator[TokenSequence]:
        """Every waiting sequence in the order `popleft` would hand them out (no other change in between)."""
        yield from self._front
        queues = [list(q) for q in self._groups.values()]
        for turn in range(max(map(len, queues), default=0)):
            for q in queues:
                if turn < len(q):
                    yield q[turn]
