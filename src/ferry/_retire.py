"""The retirement queue: where dropped handles go, and why it is shaped this way.

A pending handle owns everything its copy touches: the pinned buffer, the
device array, the event. If the handle is dropped before ``wait()`` the copy
may still be running, so those objects cannot be released; but ``__del__``
must never block (it runs wherever the garbage collector happens to run, on
any thread, possibly inside another ferry call) and must never call into the
device (it may run during interpreter shutdown or in a forked child). So a
dropped handle only *detaches* its record: one ``deque.append``, atomic under
the GIL, no lock, no device call.

The runtime drains the queue from ordinary calls (every submission and
``poll()``). Draining asks each record's event, without blocking, whether the
copy is complete; a complete record is released (its buffer goes back to the
pool, its destination is freed, its source lease ends); a record whose event
reports a device error is kept forever (its objects are abandoned: the device
may still touch them); anything else stays. Records are kept per copy stream
in submission order, and a stream runs its work in order, so the scan of one
stream stops at its first incomplete record while the other streams are
scanned too: a slow stream never holds back records of a fast one, and the
cost of a drain is the number of records released plus one query per stream.

The queue is bounded. When it is full, the *next submission* waits for the
oldest record to complete before enqueueing: backpressure lands on the
submitter, the one place where blocking is allowed and expected, never inside
``__del__``. The bound also caps how much memory dropped handles can pin.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from typing import Any

__all__: list[str] = []


class RetirementQueue:
    """Bounded queue of detached transfer records; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("retirement capacity must be >= 1")
        self.capacity = capacity
        self._incoming: deque[Any] = deque()  # lock-free pushes from finalizers
        self._by_stream: dict[int, list[Any]] = {}  # id(stream) -> records sorted by seq
        self._count = 0

    def push(self, record: Any) -> None:
        """Detach a record. Never blocks and never calls the device."""
        self._incoming.append(record)

    def __len__(self) -> int:
        return self._count + len(self._incoming)

    def full(self) -> bool:
        """True when the next submission must wait for the oldest record."""
        return len(self) >= self.capacity

    def _absorb(self) -> None:
        incoming = self._incoming
        while incoming:
            record = incoming.popleft()
            queue = self._by_stream.setdefault(id(record.stream), [])
            if not queue or queue[-1].seq < record.seq:
                queue.append(record)
            else:
                keys = [r.seq for r in queue]
                queue.insert(bisect.bisect(keys, record.seq), record)
            self._count += 1

    def drain(
        self,
        is_done: Callable[[Any], bool],
        release: Callable[[Any], None],
    ) -> None:
        """Release every record proven complete.

        ``is_done(record)`` never blocks: it returns whether the copy is
        complete, and deals with a failed record itself (it abandons it and
        returns ``True`` so that it leaves the queue; the runtime keeps failed
        records forever). ``release(record)`` frees a completed record.
        """
        if self._incoming:
            self._absorb()
        if not self._count:
            return
        for key in list(self._by_stream):
            queue = self._by_stream[key]
            done = 0
            for record in queue:
                if not is_done(record):
                    break
                done += 1
            if done:
                finished = queue[:done]
                del queue[:done]
                self._count -= done
                for record in finished:
                    release(record)
            if not queue:
                del self._by_stream[key]

    def oldest(self) -> Any | None:
        """The record submitted first among those queued, or ``None``."""
        if self._incoming:
            self._absorb()
        heads = [queue[0] for queue in self._by_stream.values() if queue]
        return min(heads, key=lambda r: r.seq) if heads else None

    def records(self) -> list[Any]:
        """Every queued record (for close())."""
        self._absorb()
        return [r for queue in self._by_stream.values() for r in queue]

    def clear(self) -> None:
        """Forget every record (after close() settled them)."""
        self._incoming.clear()
        self._by_stream.clear()
        self._count = 0
