"""The loader's slot protocol, driven by a hypothesis state machine (no processes, no device).

Every slot is free, being written by one worker, held by the main process, or in flight, never two at
once; the moves between them are the only ones the table accepts, and a refused move changes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferry._loader._slots import FREE, HELD, IN_FLIGHT, WRITING, SlotProtocolError, SlotTable

STATES = (FREE, WRITING, HELD, IN_FLIGHT)
LEGAL = {  # move -> the states it starts from
    "filled": {WRITING}, "issued": {HELD}, "completed": {IN_FLIGHT}, "discard": {WRITING, HELD},
}


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.table: SlotTable | None = None
        self.model: dict[int, tuple[str, int, int]] = {}
        self.next_batch = 0

    @precondition(lambda self: self.table is None)
    @rule(n=st.integers(1, 6))
    def make(self, n: int) -> None:
        self.n = n
        self.table = SlotTable(n)
        self.model = {i: (FREE, -1, -1) for i in range(n)}

    def _in(self, *states: str) -> list[int]:
        return [i for i, (s, _, _) in self.model.items() if s in states]

    @precondition(lambda self: self.table is not None)
    @rule(worker=st.integers(0, 3))
    def take(self, worker: int) -> None:
        assert self.table is not None
        batch = self.next_batch
        slot = self.table.take(worker, batch)
        if not self._in(FREE):
            assert slot is None
            return
        assert slot is not None and self.model[slot][0] == FREE
        self.next_batch += 1
        self.model[slot] = (WRITING, worker, batch)

    @precondition(lambda self: self.table is not None)
    @rule(data=st.data())
    def filled(self, data: Any) -> None:
        assert self.table is not None
        writing = self._in(WRITING)
        if not writing:
            return
        slot = data.draw(st.sampled_from(writing))
        _, worker, batch = self.model[slot]
        if data.draw(st.booleans()):  # someone else claims it, or another batch: refused
            with pytest.raises(SlotProtocolError):
                self.table.filled(slot, worker + 1, batch)
            with pytest.raises(SlotProtocolError):
                self.table.filled(slot, worker, batch + 1)
        self.table.filled(slot, worker, batch)
        self.model[slot] = (HELD, -1, batch)

    @precondition(lambda self: self.table is not None)
    @rule(data=st.data())
    def issued(self, data: Any) -> None:
        assert self.table is not None
        held = self._in(HELD)
        if not held:
            return
        slot = data.draw(st.sampled_from(held))
        batch = self.model[slot][2]
        self.table.issued(slot, batch)
        self.model[slot] = (IN_FLIGHT, -1, batch)

    @precondition(lambda self: self.table is not None)
    @rule(data=st.data())
    def completed(self, data: Any) -> None:
        assert self.table is not None
        flying = self._in(IN_FLIGHT)
        if not flying:
            return
        slot = data.draw(st.sampled_from(flying))
        self.table.completed(slot)
        self.model[slot] = (FREE, -1, -1)

    @precondition(lambda self: self.table is not None)
    @rule(data=st.data())
    def discard(self, data: Any) -> None:
        assert self.table is not None
        candidates = self._in(WRITING, HELD)
        if not candidates:
            return
        slot = data.draw(st.sampled_from(candidates))
        self.table.discard(slot)
        self.model[slot] = (FREE, -1, -1)

    @precondition(lambda self: self.table is not None)
    @rule(data=st.data(), move=st.sampled_from(sorted(LEGAL)))
    def illegal(self, data: Any, move: str) -> None:
        """A move from a state it does not start from is refused, and changes nothing."""
        assert self.table is not None
        wrong = [i for i, (s, _, _) in self.model.items() if s not in LEGAL[move]]
        slot = data.draw(st.sampled_from([*wrong, self.n]))  # self.n: no such slot
        _, worker, batch = self.model.get(slot, (FREE, -1, -1))
        before = [self.table.state(i) for i in range(self.n)], self.table.free
        with pytest.raises(SlotProtocolError):
            if move == "filled":
                self.table.filled(slot, worker, batch)
            elif move == "issued":
                self.table.issued(slot, batch)
            else:
                getattr(self.table, move)(slot)
        assert ([self.table.state(i) for i in range(self.n)], self.table.free) == before

    @invariant()
    def matches_the_model(self) -> None:
        if self.table is None:
            return
        for slot, expected in self.model.items():
            assert self.table.state(slot) == expected
        counts = {s: self.table.count(s) for s in STATES}
        assert sum(counts.values()) == len(self.table) == self.n  # each slot in exactly one state
        assert self.table.free == counts[FREE]
        for s in STATES:
            assert self.table.slots_in(s) == self._in(s)
        writers = [(w, b) for (st_, w, b) in self.model.values() if st_ == WRITING]
        assert len({b for _, b in writers}) == len(writers)  # a batch is written into one slot only
        live = [b for (st_, _, b) in self.model.values() if st_ != FREE]
        assert len(set(live)) == len(live)


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_free_slots_are_reused_oldest_freed_first() -> None:
    table = SlotTable(3)
    assert [table.take(0, b) for b in range(3)] == [0, 1, 2]
    assert table.take(0, 3) is None
    table.discard(1)
    table.filled(2, 0, 2)
    table.issued(2, 2)
    table.completed(2)
    assert table.take(1, 4) == 1 and table.take(1, 5) == 2
    with pytest.raises(ValueError):
        SlotTable(0)
