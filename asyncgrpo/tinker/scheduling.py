"""Which training client's request runs next: in arrival order per client, round-robin across
clients.

One request of each client with work waiting runs in turn, so a client with a long queue of
``forward_backward`` calls delays another client's ``optim_step`` by at most one request per
busy client. A client whose queue was empty goes first in the ring when work arrives (it had no
turn while idle); one just served goes last. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()

    def put(self, client: str, item: T) -> None:
        if client not in self._queues:
            self._queues[client] = deque()
            self._queues.move_to_end(client, last=False)
        self._queues[client].append(item)

    def pop(self) -> tuple[str, T] | None:
        """The oldest item of the client whose turn it is (which then goes last), or None."""
        for client, queue in self._queues.items():
            item = queue.popleft()
            if queue:
                self._queues.move_to_end(client)
            else:
                del self._queues[client]
            return client, item
        return None

    def drop(self, client: str) -> list[T]:
        """Forget ``client``, returning what it still had queued."""
        return list(self._queues.pop(client, ()))

    def count(self, client: str) -> int:
        """Items ``client`` has queued."""
        queue = self._queues.get(client)
        return len(queue) if queue is not None else 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())
