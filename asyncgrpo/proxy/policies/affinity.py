"""``routing="affinity"``: KV-prefix affinity, the G rollouts of a prompt to the replica that
holds its prefix in cache (the proxy's default).

Each request's prompts arrive as chains of block hashes (:func:`~asyncgrpo.proxy.router.
request_hashes`). The policy remembers which replicas were sent each block, scores the
replicas in rotation by the prompt-specific blocks they own (blocks shared by several prompts,
such as a chat template, identify none), and prefers the best owner while it is within the
router's load bound. Ownership is claimed when a request is routed (the G rollouts arrive long
before the first finishes) and withdrawn when it fails. Why each rule: ``docs/proxy.md``,
section "Routing".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from asyncgrpo.proxy.policies.base import Chains, Decision, DecisionKind, Fleet, RoutingPolicy

__all__ = ["PrefixAffinity"]

#: Bound on the "recently recorded" prompts and on the memoized scores (cleared when reached).
_RECENT_MAX = 4096


class _Block:
    __slots__ = ("common", "owners", "successor")

    def __init__(self) -> None:
        self.owners = 0
        self.successor: int | None = None
        self.common = False


class PrefixAffinity(RoutingPolicy):
    """Prefix ownership over the replicas, identified by slot (a bit in each block's owners; a
    replica that joins again gets a new one). ``max_blocks``: LRU cap on tracked blocks."""

    name = "affinity"
    reads_prompt = True
    follows_sessions = True

    def __init__(self, *, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("need max_blocks >= 1")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._slot: dict[str, int] = {}  # replica -> bit index
        self._next_slot = 0
        self._evictions = 0
        self._withdrawals = 0  # failures that withdrew claims; success re-records only after one
        # Prompt (last hash of each chain) -> replica it was last recorded for. The G rollouts of
        # a prompt mostly repeat the same record; skip it while nothing could have undone it.
        self._recent: dict[tuple[int, ...], str] = {}
        # The G rollouts of a prompt also score the same way while no block, owner or replica
        # changed: ``_epoch`` counts such changes; last hash of a chain -> (epoch, its scores).
        self._epoch = 0
        self._memo: dict[int, tuple[int, dict[str, int]]] = {}

    @classmethod
    def create(cls, *, max_blocks: int) -> PrefixAffinity:
        return cls(max_blocks=max_blocks)

    @property
    def tracked_blocks(self) -> int:
        return len(self._blocks)

    @property
    def evictions(self) -> int:
        return self._evictions

    # -- the fleet ----------------------------------------------------------------------------

    def added(self, replica: str) -> None:
        """A new replica owns nothing yet (a new process has an empty cache)."""
        self._slot[replica] = self._next_slot
        self._next_slot += 1
        self._recent.clear()
        self._epoch += 1

    def removed(self, replica: str) -> None:
        """Its ownership bits become dead weight that is never matched again."""
        self._slot.pop(replica, None)
        self._recent.clear()
        self._epoch += 1

    def availability_changed(self, replica: str) -> None:
        self._epoch += 1

    # -- a request ----------------------------------------------------------------------------

    def choose(
        self, fleet: Fleet, chains: Chains, candidates: list[str], *, memo: bool
    ) -> tuple[str | None, DecisionKind, int]:
        """The best-scoring owner within the load bound ("affinity"); none within it
        ("spill") or no owner ("unmatched"): the least-loaded replica."""
        if not chains:
            return None, "unmatched", 0
        scores = self._memo_scores(chains[0], candidates, memo=memo)
        if not scores:
            return None, "unmatched", 0
        inflight = fleet.inflight_counts
        bound = fleet.bound(min([inflight[r] for r in candidates]))
        ranked = (
            sorted(scores, key=lambda r: (-scores[r], inflight[r])) if len(scores) > 1 else scores
        )
        for r in ranked:
            if inflight[r] <= bound:
                return r, "affinity", scores[r]
        return None, "spill", 0

    def routed(self, chains: Chains, replica: str) -> tuple[tuple[int, ...], int]:
        """Claim the request's blocks for ``replica`` (unless the same prompt was just recorded
        there): (the hashes whose ownership this request added, the withdrawal count now)."""
        claimed: tuple[int, ...] = ()
        if chains:
            key = tuple([c[-1] for c in chains if c])
            if self._recent.get(key) != replica:
                claimed = self._record(chains, replica)
                if len(self._recent) >= _RECENT_MAX:
                    self._recent.clear()
                self._recent[key] = replica
        return claimed, self._withdrawals

    def finished(self, decision: Decision, *, ok: bool) -> None:
        """Success confirms ownership, failure withdraws the request's claims."""
        r = decision.replica
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

    # -- scores and records -------------------------------------------------------------------

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

    def _record(self, chains: Chains, replica: str) -> tuple[int, ...]:
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
            self._evictions += 1
            self._recent.clear()
            changed = True
        if changed or claimed:
            self._epoch += 1
        return tuple(claimed)
