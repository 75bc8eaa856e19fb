from __future__ import annotations

from asyncgrpo.tinker.scheduling import FairQueue


def test_one_request_per_client_in_turn_in_arrival_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.put("a", f"a{i}")
    q.put("b", "b0")
    q.put("b", "b1")
    order = [q.pop() for _ in range(6)]
    assert [item for _, item in order] == ["b0", "a0", "b1", "a1", "a2", "a3"]
    assert q.pop() is None


def test_a_client_arriving_later_waits_one_request_at_most() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(10):
        q.put("long", f"fb{i}")
    assert q.pop() == ("long", "fb0")
    q.put("other", "optim")
    assert q.pop() == ("other", "optim")
    assert len(q) == 9
    assert q.drop("long")[:2] == ["fb1", "fb2"]
    assert len(q) == 0
