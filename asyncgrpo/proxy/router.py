"""Routing: pure, synchronous, deterministic (no I/O, no clock reads).

The HTTP layer asks :func:`request_hashes` for a request's block-hash chains, :meth:`Router.route`
for a replica, and reports the outcome with :meth:`Router.finish`. The router keeps what every
policy shares (replicas, requests in flight, rotation, sessions, the least-loaded fallback) and
asks its policy (:mod:`asyncgrpo.proxy.policies`: KV-prefix affinity by default, round-robin)
for the choice. Why this design (block hashes seeded by adapter name, "common" blocks, the
decision, claims at route time withdrawn on failure, scores reused for the G rollouts of a
prompt, sessions): ``docs/proxy.md``, section "Routing".
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from asyncgrpo.config.proxy import ROUTING_POLICIES
from asyncgrpo.errors import NoHealthyReplica
from asyncgrpo.proxy.policies.base import Decision, DecisionKind, RoutingPolicy

__all__ = [
    "BYTES_PER_TOKEN",
    "MAX_KEY_BLOCKS",
    "Decision",
    "Router",
    "chat_bytes",
    "make_policy",
    "request_hashes",
]

#: Bytes of rendered text that approximate one token when chunking strings and chat messages.
BYTES_PER_TOKEN = 4

#: Sessions remembered (least recently routed forgotten first).
MAX_SESSIONS = 65_536


@functools.lru_cache(maxsize=4096)
def _seed(model: str) -> int:
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=8).digest(), "little")


def token_hashes(model: str, tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of ``tokens`` in blocks of ``block_size`` (plus the partial tail)."""
    return _token_chain(model, tuple(tokens), block_size)


# The G rollouts of a prompt hash the same tokens. 128 prompts cover the groups of 1024 requests in
# flight at G=8; the cache holds their tokens: ~39 bytes per token measured (int objects and the
# tuple), 20 MB for 128 prompts of 4k tokens.
@functools.lru_cache(maxsize=128)
def _token_chain(model: str, tokens: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    h = _seed(model)
    out = []
    for i in range(0, len(tokens), block_size):
        # Tuples of ints hash deterministically across processes (only str/bytes are salted).
        h = hash((h, tokens[i : i + block_size]))
        out.append(h)
    return tuple(out)


def byte_hashes(model: str, data: bytes, chunk_bytes: int) -> tuple[int, ...]:
    """Chained hashes of ``data`` in chunks of ``chunk_bytes`` (plus the partial tail)."""
    h = _seed(model)
    out = []
    blake = hashlib.blake2b
    for i in range(0, len(data), chunk_bytes):
        d = blake(data[i : i + chunk_bytes], digest_size=8, key=h.to_bytes(8, "little")).digest()
        h = int.from_bytes(d, "little")
        out.append(h)
    return tuple(out)


def _content_bytes(content: Any) -> bytes:
    if isinstance(content, str):
        return content.encode()
    if content is None:
        return b""
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def chat_bytes(body: dict[str, Any]) -> bytes:
    """Deterministic rendering of a chat request's prompt: tools first, then each message.

    Tools come first because chat templates put them in the system turn, ahead of every message.
    """
    parts = []
    tools = body.get("tools")
    if tools:
        parts.append(b"\x1dtools\x1f" + _content_bytes(tools))
    for msg in body.get("messages") or ():
        if not isinstance(msg, dict):
            parts.append(_content_bytes(msg))
            continue
        parts.append(
            b"\x1e"
            + str(msg.get("role", "")).encode()
            + b"\x1f"
            + _content_bytes(msg.get("content"))
        )
        for key in ("name", "tool_calls", "tool_call_id"):
            if key in msg:
                parts.append(b"\x1f" + key.encode() + b"=" + _content_bytes(msg[key]))
    return b"".join(parts)


#: Most blocks of a request's routing key, over all its prompts: a prefix of each chain routes
#: as the whole would (the longest prompts vLLM takes have fewer), and hashing and recording a
#: 32 MiB body's million blocks would hold the event loop for seconds.
MAX_KEY_BLOCKS = 16_384


def request_hashes(
    body: dict[str, Any], block_size: int, max_blocks: int = MAX_KEY_BLOCKS
) -> list[tuple[int, ...]]:
    """Block-hash chains for a parsed completions or chat body: one chain per prompt, at most
    ``max_blocks`` blocks in all (the first prompts, each chain's first blocks).

    Returns ``[]`` when the body has nothing to route on (the request is then "unmatched").
    """
    model = str(body.get("model") or "")
    chunk = block_size * BYTES_PER_TOKEN
    if "messages" in body:
        return [byte_hashes(model, chat_bytes(body)[: max_blocks * chunk], chunk)]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [
            byte_hashes(model, prompt[: max_blocks * chunk].encode()[: max_blocks * chunk], chunk)
        ]
    if not isinstance(prompt, list) or not prompt:
        return []
    if isinstance(prompt[0], int):
        return [token_hashes(model, prompt[: max_blocks * block_size], block_size)]
    chains: list[tuple[int, ...]] = []
    left = max_blocks
    for p in prompt:
        if left <= 0:
            break
        if isinstance(p, str):
            chains.append(byte_hashes(model, p[: left * chunk].encode()[: left * chunk], chunk))
        elif isinstance(p, list) and all(isinstance(t, int) for t in p[: left * block_size]):
            chains.append(token_hashes(model, p[: left * block_size], block_size))
        else:
            continue
        left -= len(chains[-1]) or 1
    return chains


def make_policy(name: str, *, max_blocks: int = 1_000_000) -> RoutingPolicy:
    """The routing policy ``name`` (a key of ``ROUTING_POLICIES``), given the router's
    settings."""
    try:
        module, _, cls = ROUTING_POLICIES[name].partition(":")
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}: one of {', '.join(ROUTING_POLICIES)}"
        ) from None
    policy: type[RoutingPolicy] = getattr(importlib.import_module(module), cls)
    return policy.create(max_blocks=max_blocks)


class Router:
    """Routing state over a set of replicas, identified by name (their base URL in the proxy).

    ``policy`` (a name of ``ROUTING_POLICIES``) chooses among the replicas in rotation; where it
    leaves the choice, the least-loaded replica gets the request (round-robin on ties). A
    preferred replica (the policy's, a session's home) may win while its in-flight count is at
    most ``imbalance`` above the least-loaded available replica's, or at most
    ``imbalance_ratio`` times it (under heavy load a fixed gap of a few requests would spill
    whole GRPO groups). ``max_blocks``: LRU cap on the blocks a prefix policy tracks.

    Sessions (under a policy that follows them: affinity): a request that names its session (a
    multi-turn episode or group; the proxy passes a hash of the client's ``X-Session-ID``) goes
    to the session's home, the replica its first request went to, under the same load bound,
    before the policy is asked. A turn's prompt is the previous turn's whole sequence, whose last
    block the previous prompt held only partially, so prefix scoring alone takes the earlier
    blocks for a shared template. A request over the bound (or retried elsewhere) is routed as
    if it had no session, and the home stays: moving it would take the group's other episodes
    along. The home moves only when its replica leaves rotation. ``max_sessions``: LRU cap.
    """

    def __init__(
        self,
        *,
        imbalance: int = 8,
        imbalance_ratio: float = 1.5,
        max_blocks: int = 1_000_000,
        max_sessions: int = MAX_SESSIONS,
        policy: str = "affinity",
    ) -> None:
        if imbalance < 0 or imbalance_ratio < 1 or max_blocks < 1 or max_sessions < 0:
            raise ValueError(
                "need imbalance >= 0, imbalance_ratio >= 1, max_blocks >= 1 and max_sessions >= 0"
            )
        self.imbalance = imbalance
        self.imbalance_ratio = imbalance_ratio
        self.max_sessions = max_sessions
        self.policy = make_policy(policy, max_blocks=max_blocks)
        self._inflight: dict[str, int] = {}
        #: requests in flight per replica, for the policy (the live map: read, never write)
        self.inflight_counts = self._inflight
        self._available: dict[str, bool] = {}
        self._rr = 0
        self.decisions: dict[DecisionKind, int] = {
            "session": 0,
            "affinity": 0,
            "spill": 0,
            "unmatched": 0,
        }
        self._sessions: OrderedDict[int, str] = OrderedDict()  # session -> its home replica
        self.session_moves = 0  # requests of known sessions sent away from home (gone, busy, retry)

    # -- replicas ---------------------------------------------------------------------------

    @property
    def replicas(self) -> list[str]:
        return list(self._available)

    def add_replica(self, name: str, *, available: bool = True) -> None:
        """Register a replica; it owns nothing yet (a new process has an empty cache)."""
        if name in self._available:
            self.set_available(name, available)
            return
        self._inflight[name] = 0
        self._available[name] = available
        self.policy.added(name)

    def remove_replica(self, name: str) -> None:
        """Forget a replica (what a policy recorded for it is never matched again)."""
        self._inflight.pop(name, None)
        self._available.pop(name, None)
        self.policy.removed(name)

    def set_available(self, name: str, available: bool) -> None:
        """Take a replica out of (or back into) rotation; it keeps what it owns."""
        if name in self._available and self._available[name] != available:
            self._available[name] = available
            self.policy.availability_changed(name)

    def is_available(self, name: str) -> bool:
        return self._available.get(name, False)

    def inflight(self, name: str) -> int:
        return self._inflight.get(name, 0)

    @property
    def tracked_blocks(self) -> int:
        return self.policy.tracked_blocks

    @property
    def evictions(self) -> int:
        return self.policy.evictions

    @property
    def tracked_sessions(self) -> int:
        return len(self._sessions)

    # -- decisions --------------------------------------------------------------------------

    def bound(self, low: int) -> float:
        """The most requests in flight a preferred replica may have: ``low`` is the least."""
        return max(low + self.imbalance, low * self.imbalance_ratio)

    def next_in_turn(self, candidates: Sequence[str]) -> str:
        """The next of ``candidates`` in the router's rotation."""
        choice = candidates[self._rr % len(candidates)]
        self._rr += 1
        return choice

    def _least_loaded(self, candidates: list[str]) -> str:
        low = min(self._inflight[r] for r in candidates)
        return self.next_in_turn([r for r in candidates if self._inflight[r] == low])

    def pick(self, *, exclude: Iterable[str] = ()) -> str:
        """A replica for a call that is not routed by prompt (``/tokenize``, a GET): round-robin
        over those available; not counted in flight. Raises :class:`NoHealthyReplica`."""
        excluded = set(exclude)
        candidates = [r for r, ok in self._available.items() if ok and r not in excluded]
        if not candidates:
            raise NoHealthyReplica("no replica in rotation")
        self._rr += 1
        return candidates[self._rr % len(candidates)]

    def route(
        self,
        chains: Sequence[Sequence[int]],
        *,
        exclude: Iterable[str] = (),
        session: int | None = None,
    ) -> Decision:
        """Choose a replica for a request whose prompts hash to ``chains``; counts it in flight.

        ``session``: the request's session key (see the class docstring), or None.
        Raises :class:`NoHealthyReplica` when no replica outside ``exclude`` is available.
        """
        available = self._available
        if exclude:
            excluded = set(exclude)
            candidates = [r for r, ok in available.items() if ok and r not in excluded]
        else:
            candidates = [r for r, ok in available.items() if ok]
        if not candidates:
            raise NoHealthyReplica("no replica in rotation")
        frozen = tuple(map(tuple, chains))  # no copy when they are tuples already
        inflight = self._inflight
        policy = self.policy
        kind: DecisionKind = "unmatched"
        matched = 0
        choice = None
        if not policy.follows_sessions:
            session = None
        elif session is not None and (home := self._sessions.get(session)) is not None:
            low = min([inflight[r] for r in candidates])
            if home in candidates and inflight[home] <= self.bound(low):
                choice, kind = home, "session"
            else:
                self.session_moves += 1
        if choice is None:
            choice, kind, matched = policy.choose(self, frozen, candidates, memo=not exclude)
            if choice is None:
                choice = self._least_loaded(candidates)
        self.decisions[kind] += 1
        inflight[choice] += 1
        if session is not None and self.max_sessions:
            sessions = self._sessions
            if not self._available.get(sessions.get(session, ""), False):
                sessions[session] = choice  # a new session, or its home left rotation
            sessions.move_to_end(session)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        claimed, withdrawals = policy.routed(frozen, choice)
        return Decision(choice, kind, matched, frozen, claimed, withdrawals)

    def finish(self, decision: Decision, *, ok: bool) -> None:
        """Report the outcome: the policy hears it (affinity: success confirms ownership,
        failure withdraws its claims)."""
        r = decision.replica
        if r in self._inflight and self._inflight[r] > 0:
            self._inflight[r] -= 1
        self.policy.finished(decision, ok=ok)

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "decisions": dict(self.decisions),
            "tracked_blocks": self.tracked_blocks,
            "tracked_sessions": len(self._sessions),
            "session_moves": self.session_moves,
            "evictions": self.evictions,
            "inflight": dict(self._inflight),
            "available": dict(self._available),
        }
