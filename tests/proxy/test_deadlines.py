"""One timer for many deadlines: each item fires once, never early, in order; discarded ones never."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.proxy.deadlines import RESOLUTION_S, Deadlines

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend(both_loops: object) -> object:
    return both_loops


async def test_items_fire_once_in_order_and_discarded_ones_never() -> None:
    loop = asyncio.get_running_loop()
    wheel = Deadlines(loop)
    fired: list[tuple[str, float]] = []
    due: dict[str, float] = {}

    class Item:
        def __init__(self, name: str, after: float) -> None:
            self.name = name
            due[name] = loop.time() + after
            self.slot = wheel.add(self, due[name])

        def on_deadline(self) -> None:
            fired.append((self.name, loop.time()))
            if self.name == "late":  # added while the wheel fires
                Item("again", 0.05)

    Item("late", 0.45)
    Item("early", 0.15)  # earlier than the armed timer: the timer moves
    gone = Item("gone", 0.15)
    gone.slot.discard(gone)
    Item("same", 0.16)
    try:
        for _ in range(100):
            if len(fired) == 4:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(3 * RESOLUTION_S)  # nothing more comes
    finally:
        wheel.close()
    assert sorted(n for n, _ in fired[:2]) == ["early", "same"]
    assert [n for n, _ in fired[2:]] == ["late", "again"]
    assert all(at >= due[name] - 0.002 for name, at in fired)  # never early


async def test_close_fires_nothing_more() -> None:
    loop = asyncio.get_running_loop()
    wheel = Deadlines(loop)
    fired: list[object] = []

    class Item:
        def on_deadline(self) -> None:
            fired.append(self)

    wheel.add(Item(), loop.time() + 0.05)
    wheel.close()
    await asyncio.sleep(0.2)
    assert fired == []
