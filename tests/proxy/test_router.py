"""Router unit tests: pure logic, no I/O."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

from asyncgrpo.errors import NoHealthyReplica
from asyncgrpo.proxy.router import (
    BYTES_PER_TOKEN,
    Router,
    byte_hashes,
    chat_bytes,
    request_hashes,
    token_hashes,
)

BS = 4  # small block size keeps the token lists readable
TEMPLATE = [900, 901, 902, 903, 904, 905, 906, 907]  # two full blocks shared by every prompt


def prompt(i: int, n_blocks: int = 2) -> list[int]:
    return TEMPLATE + [i * 100 + k for k in range(n_blocks * BS)]


def chains(tokens: list[int], model: str = "run-v1") -> list[list[int]]:
    return request_hashes({"model": model, "prompt": tokens}, BS)


def router(*names: str, **kw) -> Router:
    r = Router(**kw)
    for n in names:
        r.add_replica(n)
    return r


def test_token_hashes_are_chained_and_seeded() -> None:
    a = token_hashes("m", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 3  # two full blocks and the tail
    b = token_hashes("m", [1, 2, 3, 4, 0, 6, 7, 8, 9], 4)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # a change propagates down the chain
    assert token_hashes("m2", [1, 2, 3, 4], 4) != token_hashes("m", [1, 2, 3, 4], 4)
    # Deterministic across calls (ints hash the same in every process).
    assert token_hashes("m", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a


def test_four_request_walkthrough() -> None:
    """A and B share the template; A's rollouts stick, B goes elsewhere, a new C is unmatched."""
    r = router("r0", "r1")
    a1 = r.route(chains(prompt(1)))
    assert (a1.replica, a1.kind) == ("r0", "unmatched")
    b1 = r.route(chains(prompt(2)))
    # B's template blocks are owned by r0 but B diverges from A's successor: no prompt-specific
    # match, so B is unmatched and goes to the least-loaded replica.
    assert (b1.replica, b1.kind) == ("r1", "unmatched")
    a2 = r.route(chains(prompt(1)))
    assert (a2.replica, a2.kind) == ("r0", "affinity")
    assert a2.matched_blocks == 2  # A's two own blocks; the template is ignored
    c1 = r.route(chains(prompt(3)))
    assert c1.kind == "unmatched"
    assert r.decisions == {"session": 0, "affinity": 1, "spill": 0, "unmatched": 3}
    for d in (a1, b1, a2, c1):
        r.finish(d, ok=True)
    assert r.inflight("r0") == r.inflight("r1") == 0


def test_template_blocks_are_common() -> None:
    r = router("r0", "r1", imbalance=100)
    for i in range(10):
        r.finish(r.route(chains(prompt(i))), ok=True)
    # A prompt that shares only the template with everything seen so far matches nothing.
    d = r.route(chains(prompt(99)))
    assert d.kind == "unmatched" and d.matched_blocks == 0
    # Exactly the template: its last block has ten successors, so it and the block before it
    # identify no prompt, although r0 and r1 both own them.
    d2 = r.route(chains(TEMPLATE))
    assert d2.kind == "unmatched" and d2.matched_blocks == 0


def test_new_adapter_version_is_a_new_namespace() -> None:
    r = router("r0", "r1")
    r.finish(r.route(chains(prompt(1), "run-v1")), ok=True)
    r.finish(r.route(chains(prompt(1), "run-v1")), ok=True)
    d = r.route(chains(prompt(1), "run-v2"))
    assert d.kind == "unmatched" and d.matched_blocks == 0
    assert set(chains(prompt(1), "run-v1")[0]).isdisjoint(chains(prompt(1), "run-v2")[0])


def test_group_of_g_lands_on_one_replica_with_three_replicas() -> None:
    r = router("r0", "r1", "r2")
    G = 8
    placed: dict[int, set[str]] = {}
    pending = []
    for i in range(30):
        for _ in range(G):  # all G rollouts of a prompt arrive before any finishes
            d = r.route(chains(prompt(i)))
            placed.setdefault(i, set()).add(d.replica)
            pending.append(d)
        if len(pending) > 24:  # ~3 groups in flight
            for d in pending[:G]:
                r.finish(d, ok=True)
            del pending[:G]
    assert all(len(s) == 1 for s in placed.values()), placed
    used = {next(iter(s)) for s in placed.values()}
    assert used == {"r0", "r1", "r2"}
    assert r.decisions["unmatched"] == 30 and r.decisions["spill"] == 0


def test_bounded_imbalance_spills_to_least_loaded() -> None:
    r = router("r0", "r1", imbalance=2)
    first = r.route(chains(prompt(1)))
    assert first.replica == "r0"
    ds = [r.route(chains(prompt(1))) for _ in range(3)]
    assert [d.replica for d in ds] == ["r0", "r0", "r1"]  # r0 at 3 in flight, r1 at 0: 3 > 2
    assert [d.kind for d in ds] == ["affinity", "affinity", "spill"]


def test_owners_after_a_spill_keep_affinity_to_least_loaded_owner() -> None:
    r = router("r0", "r1", imbalance=1)
    ds = [r.route(chains(prompt(1))) for _ in range(3)]
    assert [d.replica for d in ds] == ["r0", "r0", "r1"]  # the third spilled to r1
    for d in ds:
        r.finish(d, ok=True)
    # Both replicas now own the prompt. It must not become "common": it keeps affinity,
    # to whichever owner is less loaded.
    busy = r.route(chains(prompt(7)))  # r0 gets unrelated work
    assert busy.replica == "r0"
    d = r.route(chains(prompt(1)))
    assert (d.kind, d.replica) == ("affinity", "r1")
    d2 = r.route(chains(prompt(1)))
    assert d2.kind == "affinity"


def test_round_robin_on_ties_for_unknown_prompts() -> None:
    r = router("a", "b", "c")
    picks = []
    for i in range(6):
        d = r.route(chains(prompt(i)))
        picks.append(d.replica)
        r.finish(d, ok=True)
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_failed_request_records_no_affinity() -> None:
    r = router("r0", "r1")
    d = r.route(chains(prompt(1)))
    r.finish(d, ok=False)
    d2 = r.route(chains(prompt(1)))
    assert d2.kind == "unmatched"
    # A failure does not undo ownership a concurrent success confirmed.
    r.finish(d2, ok=True)
    x = r.route(chains(prompt(1)))
    y = r.route(chains(prompt(1)))
    r.finish(x, ok=True)
    r.finish(y, ok=False)
    assert r.route(chains(prompt(1))).kind == "affinity"


def test_repeat_of_a_prompt_skips_recording_but_survives_the_first_ones_failure() -> None:
    """The 2nd..Gth rollouts of a prompt claim nothing new (the record is skipped); when the
    claimant then fails, a later success of theirs restores the ownership it withdrew."""
    r = router("r0", "r1")
    first = r.route(chains(prompt(3)))
    second = r.route(chains(prompt(3)))
    assert second.replica == first.replica and second.claimed == () and first.claimed
    r.finish(first, ok=False)
    lost = r.route(chains(prompt(3)))
    assert lost.kind == "unmatched"  # the claim is withdrawn, nothing else owns the prompt
    r.finish(lost, ok=False)
    r.finish(second, ok=True)
    again = r.route(chains(prompt(3)))
    assert again.kind == "affinity" and again.replica == first.replica


def test_unavailable_replicas_are_never_chosen() -> None:
    r = router("r0", "r1")
    r.finish(r.route(chains(prompt(1))), ok=True)  # r0 owns prompt 1
    r.set_available("r0", False)
    for i in range(5):
        assert r.route(chains(prompt(1 if i % 2 else i + 10))).replica == "r1"
    r.set_available("r1", False)
    with pytest.raises(NoHealthyReplica):
        r.route(chains(prompt(1)))
    r.set_available("r0", True)
    assert r.route(chains(prompt(1))).kind == "affinity"  # it kept its ownership


def test_exclude_and_removed_replica() -> None:
    r = router("r0", "r1")
    d = r.route(chains(prompt(1)))
    assert r.route(chains(prompt(1)), exclude=[d.replica]).replica != d.replica
    r.remove_replica("r0")
    r.add_replica("r0")  # a restarted process: new slot, owns nothing
    assert r.route(chains(prompt(5)), exclude=["r1"]).replica == "r0"


def test_pick_rotates_over_available_replicas_without_counting_in_flight() -> None:
    r = router("r0", "r1", "r2")
    r.set_available("r2", False)
    picks = [r.pick() for _ in range(4)]
    assert sorted(set(picks)) == ["r0", "r1"] and picks[0] != picks[1]
    assert r.pick(exclude=["r0"]) == "r1"
    assert all(r.inflight(n) == 0 for n in ("r0", "r1", "r2"))
    with pytest.raises(NoHealthyReplica):
        r.pick(exclude=["r0", "r1"])


def test_eviction_bound() -> None:
    r = router("r0", "r1", max_blocks=50)
    for i in range(200):
        r.finish(r.route(chains(prompt(i))), ok=True)
    assert r.tracked_blocks <= 50
    assert r.evictions > 0
    # Recent prompts still match, old ones were forgotten.
    assert r.route(chains(prompt(199))).kind == "affinity"
    assert r.route(chains(prompt(0))).kind == "unmatched"


def test_batched_and_string_prompts() -> None:
    body = {"model": "m", "prompt": [prompt(1), prompt(2)]}
    cs = request_hashes(body, BS)
    assert len(cs) == 2 and cs[0] == chains(prompt(1), "m")[0]
    s = "x" * (BS * BYTES_PER_TOKEN * 3)
    assert len(request_hashes({"model": "m", "prompt": s}, BS)[0]) == 3
    assert request_hashes({"model": "m", "prompt": ["ab", "cd"]}, BS)[1] == byte_hashes(
        "m", b"cd", BS * BYTES_PER_TOKEN
    )
    assert request_hashes({"model": "m"}, BS) == []
    r = router("r0", "r1")
    d = r.route(request_hashes(body, BS))
    r.finish(d, ok=True)
    # Both prompts of the batch were recorded on the chosen replica.
    assert r.route(chains(prompt(2), "m")).replica == d.replica


def test_chat_requests_get_affinity() -> None:
    system = {"role": "system", "content": "You are a careful math tutor. " * 40}

    def chat(q: str) -> dict:
        return {"model": "m", "messages": [system, {"role": "user", "content": q}]}

    assert chat_bytes(chat("a")) == chat_bytes(chat("a"))
    assert chat_bytes(chat("a")) != chat_bytes(chat("b"))
    # Role is part of the rendering.
    swapped = {"model": "m", "messages": [{"role": "user", "content": system["content"]}]}
    assert chat_bytes(swapped) != chat_bytes({"model": "m", "messages": [system]})
    bs = 16
    r = router("r0", "r1")
    questions = [f"Question {i}: what is {i} + {i}? " * 30 for i in range(8)]
    where = {}
    for q in questions:
        ds = [r.route(request_hashes(chat(q), bs)) for _ in range(4)]
        assert len({d.replica for d in ds}) == 1
        where[q] = ds[0].replica
        for d in ds:
            r.finish(d, ok=True)
    assert set(where.values()) == {"r0", "r1"}  # the shared system prompt does not pin them
    # Content parts (list content) and tools are rendered too.
    parts = {
        "model": "m",
        "tools": [{"type": "function"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert b"tools" in chat_bytes(parts) and b"hi" in chat_bytes(parts)


def test_round_robin_policy_ignores_prefixes() -> None:
    r = router("r0", "r1", policy="round_robin")
    picks = [r.route(chains(prompt(1))).replica for _ in range(4)]
    assert picks == ["r0", "r1", "r0", "r1"]
    assert r.tracked_blocks == 0


def test_bytes_per_tracked_block() -> None:
    """The figure docs/proxy.md quotes: measured, and bounded so a regression shows."""
    r = router("r0", "r1")
    rng = random.Random(0)
    tokens = [[rng.randrange(50000) for _ in range(BS * 8)] for _ in range(500)]
    cs = [chains(t) for t in tokens]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for c in cs:
        r.finish(r.route(c), ok=True)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_block = grown / r.tracked_blocks
    print(f"bytes per tracked block: {per_block:.0f} (python {sys.version_info[:2]})")
    assert r.tracked_blocks == 500 * 8
    assert 50 < per_block < 400


def test_memoized_scores_always_match_a_fresh_computation() -> None:
    """The G rollouts of a prompt reuse its scores while nothing changed; whatever happens in
    between (records, failures, evictions, replicas leaving and joining), a reused score is
    exactly what scoring from scratch gives."""
    rng = random.Random(7)
    r = router("a", "b", "c", max_blocks=40)
    prompts = [prompt(i, n_blocks=rng.randrange(1, 4)) for i in range(12)]
    inflight = []
    reused = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.6:
            c = chains(rng.choice(prompts))
            before = r.policy._memo.get(c[0][-1])
            hit = before is not None and before[0] == r.policy._epoch
            candidates = [n for n, ok in r._available.items() if ok]
            fresh = r.policy._scores(tuple(c[0]), candidates)
            if candidates:
                inflight.append(r.route(c))
            if hit:
                reused += 1
                assert before[1] == fresh, step
        elif op < 0.9 and inflight:
            r.finish(inflight.pop(rng.randrange(len(inflight))), ok=rng.random() < 0.8)
        elif op < 0.95:
            r.set_available(rng.choice("abc"), rng.random() < 0.7)
        else:
            name = rng.choice("abc")
            r.remove_replica(name)
            r.add_replica(name)
    assert reused > 100  # the memo is actually used


# -- sessions -----------------------------------------------------------------------------------


def episode_turns(i: int, turns: int = 3) -> list[list[int]]:
    """The prompts of a multi-turn episode: each turn's prompt is the previous one plus the
    model's tokens and the environment's (so its last, partial block becomes a full one)."""
    ids = TEMPLATE + [i * 1000 + k for k in range(BS + 2)]  # ends in a partial block
    out = [list(ids)]
    for t in range(1, turns):
        ids += [i * 1000 + 100 * t + k for k in range(5)]
        out.append(list(ids))
    return out


def play(r: Router, episodes: int, *, sessions: bool) -> tuple[float, dict[str, int]]:
    """Episodes in flight together, turn after turn, their turns arriving in any order; the
    share of later turns routed to the replica of the episode's previous turn."""
    plays = [episode_turns(i) for i in range(episodes)]
    rng = random.Random(3)
    last: dict[int, str] = {}
    follow = []
    for t in range(3):
        ds = []
        for i in rng.sample(range(episodes), episodes):
            d = r.route(chains(plays[i][t]), session=i if sessions else None)
            if t:
                follow.append(d.replica == last[i])
            last[i] = d.replica
            ds.append(d)
        for d in ds:
            r.finish(d, ok=True)
    return sum(follow) / len(follow), dict(r.decisions)


def test_prefixes_alone_lose_a_multi_turn_episode() -> None:
    """Why sessions: the next turn's prompt turns the previous one's partial last block into a
    full block with another hash, a second successor, so the earlier blocks look common."""
    share, decisions = play(router("r0", "r1", "r2"), 12, sessions=False)
    assert decisions["unmatched"] == 36 and share < 0.7


def test_a_session_keeps_its_turns_on_one_replica() -> None:
    r = router("r0", "r1", "r2")
    share, decisions = play(r, 12, sessions=True)
    assert share == 1.0
    assert decisions == {"session": 24, "affinity": 0, "spill": 0, "unmatched": 12}
    assert r.tracked_sessions == 12 and r.session_moves == 0
    spread = {r.route(chains(episode_turns(i)[2]), session=i).replica for i in range(12)}
    assert spread == {"r0", "r1", "r2"}  # the sessions are spread over the replicas


def test_a_session_yields_to_the_load_bound_rotation_and_retries() -> None:
    r = router("r0", "r1", imbalance=2, imbalance_ratio=1.0)
    first = r.route(chains(prompt(1)), session=7)
    assert first.replica == "r0"
    busy = [r.route(chains(prompt(2)), session=8) for _ in range(2)]
    assert [d.replica for d in busy] == ["r1", "r1"]  # session 8's home: r1
    # r0 at 1 in flight, r1 at 2: within the bound, the session wins over r1's load...
    assert r.route(chains(prompt(9)), session=8).kind == "session"
    # ...but not past it: r1 at 3, r0 at 1 -> 3 <= 1 + 2 still; at 4 it goes elsewhere
    assert r.route(chains(prompt(9)), session=8).replica == "r1"
    moved = r.route(chains(prompt(9)), session=8)
    assert (moved.replica, moved.kind, r.session_moves) == ("r0", "spill", 1)
    # the home stays: r0 at 2, r1 at 4 is within the bound again, so the next one goes home
    back = r.route(chains(prompt(9)), session=8)
    assert (back.replica, back.kind) == ("r1", "session")
    retry = r.route(chains(prompt(1)), session=7, exclude=["r0"])  # a retry elsewhere
    assert retry.replica == "r1" and r.session_moves == 2
    assert r.route(chains(prompt(1)), session=7).replica == "r0"  # still session 7's home
    r.set_available("r1", False)  # session 8's home leaves rotation: the home moves for good
    assert r.route(chains(prompt(2)), session=8).replica == "r0" and r.session_moves == 3
    r.set_available("r1", True)
    again = r.route(chains(prompt(2)), session=8)
    assert (again.replica, again.kind, r.session_moves) == ("r0", "session", 3)


def test_sessions_are_bounded_and_round_robin_ignores_them() -> None:
    r = router("r0", "r1", max_sessions=2)
    for s in (1, 2, 3):
        r.finish(r.route(chains(prompt(s)), session=s), ok=True)
    assert r.tracked_sessions == 2  # session 1, the least recently routed, is forgotten
    assert r.route(chains(prompt(100)), session=1).kind != "session"
    assert r.route(chains(prompt(100)), session=3).kind == "session"
    rr = router("r0", "r1", policy="round_robin")
    picks = [rr.route(chains(prompt(1)), session=5).replica for _ in range(4)]
    assert picks == ["r0", "r1", "r0", "r1"] and rr.tracked_sessions == 0
