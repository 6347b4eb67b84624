"""The slot protocol of a loader's ring: who may touch each slot, and when.

A ring has ``n`` slots. Each is in exactly one state at a time:

``FREE``
    Nobody uses it; the main process may give it to a worker.
``WRITING``
    Given to one worker for one batch: only that worker writes it.
``HELD``
    The worker is done and its descriptor arrived: the main process holds the
    batch (it waits there until its turn comes), nobody writes it.
``IN_FLIGHT``
    The main process issued the batch's copies from it: the device reads it.
    It becomes free once every copy is proven complete.

Moves: ``take`` (FREE -> WRITING), ``filled`` (WRITING -> HELD), ``issued``
(HELD -> IN_FLIGHT), ``completed`` (IN_FLIGHT -> FREE), and ``discard``
(WRITING or HELD -> FREE: the batch failed, did not fit, or the loader
stops; a slot being written is discarded only once its worker is known to
have stopped writing). Any other move raises :class:`SlotProtocolError`. This
module makes no system call: the loader drives it from its main process, and a
state-machine test drives it alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__: list[str] = []

FREE, WRITING, HELD, IN_FLIGHT = "free", "writing", "held", "in flight"


class SlotProtocolError(AssertionError):
    """A move the slot protocol forbids (a bug in the loader, never a user's mistake)."""


@dataclass(slots=True)
class _Slot:
    state: str = FREE
    worker: int = -1  # the worker writing it (WRITING), else -1
    batch: int = -1  # the batch it holds (WRITING, HELD, IN_FLIGHT), else -1


class SlotTable:
    """The states of ``n`` slots; free ones are handed out oldest-freed first."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a ring needs at least one slot, got {n}")
        self._slots = [_Slot() for _ in range(n)]
        self._n = n
        self._free: deque[int] = deque(range(n))

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def free(self) -> int:
        """How many slots are free."""
        return len(self._free)

    def state(self, slot: int) -> tuple[str, int, int]:
        """``(state, worker, batch)`` of one slot."""
        s = self._slots[slot]
        return s.state, s.worker, s.batch

    def count(self, state: str) -> int:
        """How many slots are in ``state``."""
        return sum(1 for s in self._slots if s.state == state)

    def slots_in(self, state: str) -> list[int]:
        """The slots in ``state``, by index."""
        return [i for i, s in enumerate(self._slots) if s.state == state]

    def take(self, worker: int, batch: int) -> int | None:
        """A free slot for ``worker`` to write ``batch`` into (FREE -> WRITING), or None if none is free."""
        if not self._free:
            return None
        slot = self._free.popleft()
        s = self._slots[slot]
        if s.state != FREE:
            raise SlotProtocolError(f"slot {slot} was listed free while {s.state}")
        s.state, s.worker, s.batch = WRITING, worker, batch
        return slot

    def filled(self, slot: int, worker: int, batch: int) -> None:
        """The worker wrote ``batch`` into ``slot`` (WRITING -> HELD)."""
        s = self._slots[slot] if 0 <= slot < self._n else self._at(slot)
        if s.state != WRITING or s.worker != worker or s.batch != batch:
            raise SlotProtocolError(
                f"slot {slot} reported filled with batch {batch} by worker {worker} while "
                f"{s.state} (worker {s.worker}, batch {s.batch})"
            )
        s.state, s.worker = HELD, -1

    def issued(self, slot: int, batch: int) -> None:
        """The batch's copies were issued from ``slot`` (HELD -> IN_FLIGHT)."""
        s = self._slots[slot] if 0 <= slot < self._n else self._at(slot)
        if s.state != HELD or s.batch != batch:
            raise SlotProtocolError(
                f"copies issued from slot {slot} for batch {batch} while {s.state} (batch {s.batch})")
        s.state = IN_FLIGHT

    def completed(self, slot: int) -> None:
        """Every copy from ``slot`` completed (IN_FLIGHT -> FREE)."""
        s = self._slots[slot] if 0 <= slot < self._n else self._at(slot)
        if s.state != IN_FLIGHT:
            raise SlotProtocolError(f"slot {slot} reported copied while {s.state}")
        s.state, s.worker, s.batch = FREE, -1, -1
        self._free.append(slot)

    def discard(self, slot: int) -> None:
        """The slot's batch is dropped before its copies were issued (WRITING or HELD -> FREE)."""
        s = self._at(slot)
        if s.state not in (WRITING, HELD):
            raise SlotProtocolError(f"slot {slot} discarded while {s.state}")
        self._release(slot, s)

    def _at(self, slot: int) -> _Slot:
        if not 0 <= slot < len(self._slots):
            raise SlotProtocolError(f"no slot {slot} in a ring of {len(self._slots)}")
        return self._slots[slot]

    def _release(self, slot: int, s: _Slot) -> None:
        s.state, s.worker, s.batch = FREE, -1, -1
        self._free.append(slot)
