"""KV-prefix-affinity routing: pure, synchronous, deterministic (no I/O, no clock reads).

The HTTP layer asks :func:`request_hashes` for a request's block-hash chains, :meth:`Router.route`
for a replica, and reports the outcome with :meth:`Router.finish`. Why this design (block hashes
seeded by adapter name, "common" blocks, the decision, claims at route time withdrawn on failure,
scores reused for the G rollouts of a prompt, sessions): ``docs/proxy.md``, section "Routing".
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncgrpo.errors import NoHealthyReplica

__all__ = [
    "BYTES_PER_TOKEN",
    "MAX_KEY_BLOCKS",
    "Decision",
    "Router",
    "chat_bytes",
    "request_hashes",
]

#: Bytes of rendered text that approximate one token when chunking strings and chat messages.
BYTES_PER_TOKEN = 4

DecisionKind = Literal["session", "affinity", "spill", "unmatched"]

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
        return [byte_hashes(model, prompt[: max_blocks * chunk].encode()[: max_blocks * chunk],
                            chunk)]  # fmt: skip
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


#: Bound on the "recently recorded" prompts (cleared when reached).
_RECENT_MAX = 4096


class _Block:
    __slots__ = ("common", "owners", "successor")

    def __init__(self) -> None:
        self.owners = 0
        self.successor: int | None = None
        self.common = False


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~4x more per request
class Decision:
    """Where a request goes and why; hand it back to :meth:`Router.finish`."""

    replica: str
    kind: DecisionKind
    matched_blocks: int
    chains: tuple[tuple[int, ...], ...]
    claimed: tuple[int, ...]  # hashes whose ownership this request added
    withdrawals: int  # the router's withdrawal count when routed


class Router:
    """Routing state over a set of replicas, identified by name (their base URL in the proxy).

    An owner may win while its in-flight count is at most ``imbalance`` above the least-loaded
    available replica's, or at most ``imbalance_ratio`` times it (under heavy load a fixed gap of
    a few requests would spill whole GRPO groups). ``max_blocks``: LRU cap on tracked blocks.
    ``policy="round_robin"`` ignores prefixes (the baseline the benchmark compares against).

    Sessions: a request that names its session (a multi-turn episode or group; the proxy passes
    a hash of the client's ``X-Session-ID``) goes to the session's home, the replica its first
    request went to, under the same load bound, before prefixes are looked at. A turn's prompt
    is the previous turn's whole sequence, whose last block the previous prompt held only
    partially, so prefix scoring alone takes the earlier blocks for a shared template. A request
    over the bound (or retried elsewhere) is routed as if it had no session, and the home stays:
    moving it would take the group's other episodes along. The home moves only when its replica
    leaves rotation. ``max_sessions``: LRU cap.
    """

    def __init__(
        self,
        *,
        imbalance: int = 8,
        imbalance_ratio: float = 1.5,
        max_blocks: int = 1_000_000,
        max_sessions: int = MAX_SESSIONS,
        policy: Literal["affinity", "round_robin"] = "affinity",
    ) -> None:
        if imbalance < 0 or imbalance_ratio < 1 or max_blocks < 1 or max_sessions < 0:
            raise ValueError(
                "need imbalance >= 0, imbalance_ratio >= 1, max_blocks >= 1 and max_sessions >= 0"
            )
        self.imbalance = imbalance
        self.imbalance_ratio = imbalance_ratio
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.policy = policy
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._slot: dict[str, int] = {}  # replica -> bit index; a re-added replica gets a new one
        self._next_slot = 0
        self._inflight: dict[str, int] = {}
        self._available: dict[str, bool] = {}
        self._rr = 0
        self.evictions = 0
        self._withdrawals = 0  # failures that withdrew claims; success re-records only after one
        # Prompt (last hash of each chain) -> replica it was last recorded for. The G rollouts of
        # a prompt mostly repeat the same record; skip it while nothing could have undone it.
        self._recent: dict[tuple[int, ...], str] = {}
        # The G rollouts of a prompt also score the same way while no block, owner or replica
        # changed: ``_epoch`` counts such changes; last hash of a chain -> (epoch, its scores).
        self._epoch = 0
        self._memo: dict[int, tuple[int, dict[str, int]]] = {}
        self.decisions: dict[DecisionKind, int] = {
            "session": 0, "affinity": 0, "spill": 0, "unmatched": 0
        }  # fmt: skip
        self._sessions: OrderedDict[int, str] = OrderedDict()  # session -> its home replica
        self.session_moves = 0  # requests of known sessions sent away from home (gone, busy, retry)

    # -- replicas ---------------------------------------------------------------------------

    @property
    def replicas(self) -> list[str]:
        return list(self._slot)

    def add_replica(self, name: str, *, available: bool = True) -> None:
        """Register a replica; it owns nothing yet (a new process has an empty cache)."""
        if name in self._slot:
            self.set_available(name, available)
            return
        self._slot[name] = self._next_slot
        self._next_slot += 1
        self._recent.clear()
        self._epoch += 1
        self._inflight[name] = 0
        self._available[name] = available

    def remove_replica(self, name: str) -> None:
        """Forget a replica; its ownership bits become dead weight that is never matched again."""
        self._slot.pop(name, None)
        self._recent.clear()
        self._epoch += 1
        self._inflight.pop(name, None)
        self._available.pop(name, None)

    def set_available(self, name: str, available: bool) -> None:
        """Take a replica out of (or back into) rotation; it keeps what it owns."""
        if name in self._available and self._available[name] != available:
            self._available[name] = available
            self._epoch += 1

    def is_available(self, name: str) -> bool:
        return self._available.get(name, False)

    def inflight(self, name: str) -> int:
        return self._inflight.get(name, 0)

    @property
    def tracked_blocks(self) -> int:
        return len(self._blocks)

    # -- decisions --------------------------------------------------------------------------

    def _least_loaded(self, candidates: list[str]) -> str:
        low = min(self._inflight[r] for r in candidates)
        tied = [r for r in candidates if self._inflight[r] == low]
        choice = tied[self._rr % len(tied)]
        self._rr += 1
        return choice

    def pick(self, *, exclude: Iterable[str] = ()) -> str:
        """A replica for a call that is not routed by prompt (``/tokenize``, a GET): round-robin
        over those available; not counted in flight. Raises :class:`NoHealthyReplica`."""
        excluded = set(exclude)
        candidates = [r for r, ok in self._available.items() if ok and r not in excluded]
        if not candidates:
            raise NoHealthyReplica("no replica in rotation")
        self._rr += 1
        return candidates[self._rr % len(candidates)]

    @property
    def tracked_sessions(self) -> int:
        return len(self._sessions)

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
        kind: DecisionKind = "unmatched"
        matched = 0
        choice = None
        if self.policy == "round_robin":
            choice = candidates[self._rr % len(candidates)]
            self._rr += 1
            session = None
        elif session is not None and (home := self._sessions.get(session)) is not None:
            low = min([inflight[r] for r in candidates])
            if home in candidates and inflight[home] <= self._bound(low):
                choice, kind = home, "session"
            else:
                self.session_moves += 1
        if choice is None and self.policy == "affinity" and frozen:
            scores = self._memo_scores(frozen[0], candidates, memo=not exclude)
            if scores:
                bound = self._bound(min([inflight[r] for r in candidates]))
                ranked = (
                    sorted(scores, key=lambda r: (-scores[r], inflight[r]))
                    if len(scores) > 1
                    else scores
                )
                for r in ranked:
                    if inflight[r] <= bound:
                        choice, kind, matched = r, "affinity", scores[r]
                        break
                else:
                    kind = "spill"
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
        claimed: tuple[int, ...] = ()
        if self.policy == "affinity" and frozen:
            key = tuple([c[-1] for c in frozen if c])
            if self._recent.get(key) != choice:
                claimed = self._record(frozen, choice)
                if len(self._recent) >= _RECENT_MAX:
                    self._recent.clear()
                self._recent[key] = choice
        return Decision(choice, kind, matched, frozen, claimed, self._withdrawals)

    def _bound(self, low: int) -> float:
        """The most requests in flight a preferred replica may have: ``low`` is the least."""
        return max(low + self.imbalance, low * self.imbalance_ratio)

    def _memo_scores(
        self, chain: Sequence[int], candidates: list[str], *, memo: bool
    ) -> dict[str, int]:
        """:meth:`_scores`, reused while nothing changed (``memo``: candidates are all replicas
        in rotation)."""
        if not memo or not chain:
            return self._scores(chain, candidates)
        hit = self._memo.get(chain[-1])
        if hit is not None and hit[0] == self._epoch:
            return hit[1]
        scores = self._scores(chain, candidates)
        if len(self._memo) >= _RECENT_MAX:
            self._memo.clear()
        self._memo[chain[-1]] = (self._epoch, scores)
        return scores

    def _scores(self, chain: Sequence[int], candidates: list[str]) -> dict[str, int]:
        get = self._blocks.get
        owned: list[int] = []  # owner bitmasks of the prompt-specific matched blocks so far
        last = len(chain) - 1
        for i, h in enumerate(chain):
            block = get(h)
            if block is None:
                break  # chained: nothing after a miss can match
            successor = block.successor
            if block.common or (i < last and successor is not None and successor != chain[i + 1]):
                # Shared by several prompts (or about to be, by this one): it and every block
                # before it identify no prompt.
                owned.clear()
                continue
            owned.append(block.owners)
        scores: dict[str, int] = {}
        if not owned:
            return scores
        slot = self._slot
        for r in candidates:
            bit = 1 << slot[r]
            n = len(owned) - [owners & bit for owners in owned].count(0)
            if n:
                scores[r] = n
        return scores

    def _record(self, chains: tuple[tuple[int, ...], ...], replica: str) -> tuple[int, ...]:
        slot = self._slot.get(replica)
        if slot is None:
            return ()
        bit = 1 << slot
        blocks = self._blocks
        claimed = []
        changed = False
        for chain in chains:
            prev: _Block | None = None
            for h in chain:
                block = blocks.get(h)
                if block is None:
                    block = blocks[h] = _Block()
                else:
                    blocks.move_to_end(h)
                if not block.owners & bit:
                    block.owners |= bit
                    claimed.append(h)
                if prev is not None and not prev.common:
                    if prev.successor is None:
                        prev.successor = h
                        changed = True
                    elif prev.successor != h:
                        prev.common = True
                        changed = True
                prev = block
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
            self.evictions += 1
            self._recent.clear()
            changed = True
        if changed or claimed:
            self._epoch += 1
        return tuple(claimed)

    def finish(self, decision: Decision, *, ok: bool) -> None:
        """Report the outcome: success confirms ownership, failure withdraws its claims."""
        r = decision.replica
        if r in self._inflight and self._inflight[r] > 0:
            self._inflight[r] -= 1
        if self.policy != "affinity":
            return
        if ok:
            if decision.withdrawals != self._withdrawals:
                self._record(decision.chains, r)  # a failure may have withdrawn what we rely on
            return
        self._withdrawals += 1
        self._recent.clear()
        self._epoch += 1
        slot = self._slot.get(r)
        if slot is None:
            return
        mask = ~(1 << slot)
        for h in decision.claimed:
            block = self._blocks.get(h)
            if block is not None:
                block.owners &= mask

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "decisions": dict(self.decisions),
            "tracked_blocks": len(self._blocks),
            "tracked_sessions": len(self._sessions),
            "session_moves": self.session_moves,
            "evictions": self.evictions,
            "inflight": dict(self._inflight),
            "available": dict(self._available),
        }
