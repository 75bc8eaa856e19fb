"""What a routing policy is: it picks a replica for a request and hears how the request ended.

The :class:`~asyncgrpo.proxy.router.Router` keeps what every policy shares (the replicas, their
requests in flight, which are in rotation, sessions, the least-loaded fallback, the decision
counts) and asks its policy at three moments: :meth:`RoutingPolicy.choose` a replica among those
in rotation (or leave it to the least-loaded), :meth:`RoutingPolicy.routed` once the request is
sent there, :meth:`RoutingPolicy.finished` with its outcome; the ``added``, ``removed`` and
``availability_changed`` hooks hear the fleet change. A policy is pure like the router: no I/O,
no clock reads. The policies are named in ``ROUTING_POLICIES`` (``asyncgrpo/config/proxy.py``),
the values ``ProxyConfig.routing`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

__all__ = ["Chains", "Decision", "DecisionKind", "Fleet", "RoutingPolicy"]

#: Why a replica was chosen: its session's home, a prefix it owns, a spill to the least-loaded
#: replica (the owners were too busy), or none of these (the least-loaded replica, or a policy
#: that does not look at the request).
DecisionKind = Literal["session", "affinity", "spill", "unmatched"]

#: A request's block-hash chains, one per prompt (:func:`~asyncgrpo.proxy.router.request_hashes`).
Chains = tuple[tuple[int, ...], ...]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~4x more per request
class Decision:
    """Where a request goes and why; hand it back to :meth:`Router.finish`."""

    replica: str
    kind: DecisionKind
    matched_blocks: int
    chains: Chains
    claimed: tuple[int, ...]  # hashes whose ownership this request added (the policy's)
    withdrawals: int  # the policy's count of withdrawn claims when routed


class Fleet(Protocol):
    """What a policy reads of the router while it chooses."""

    @property
    def inflight_counts(self) -> dict[str, int]:
        """Requests in flight per replica (read only)."""
        ...

    def bound(self, low: int) -> float:
        """The most requests in flight a preferred replica may have while the least-loaded
        one has ``low``."""
        ...

    def next_in_turn(self, candidates: Sequence[str]) -> str:
        """The next of ``candidates`` in the router's rotation."""
        ...


class RoutingPolicy:
    """A routing policy; subclasses override :meth:`choose` and what else they need."""

    name: ClassVar[str]
    #: the proxy hashes each generation request's prompt into block chains for it (otherwise a
    #: policy always gets empty chains)
    reads_prompt: ClassVar[bool] = False
    #: a request that names its session goes to the session's home under it (see ``Router``)
    follows_sessions: ClassVar[bool] = False

    @classmethod
    def create(cls, *, max_blocks: int) -> RoutingPolicy:
        """The policy, given the router's settings; it takes those it uses."""
        return cls()

    def choose(
        self, fleet: Fleet, chains: Chains, candidates: list[str], *, memo: bool
    ) -> tuple[str | None, DecisionKind, int]:
        """A replica among ``candidates`` (None: the least-loaded one), the decision's kind and
        the blocks it matched. ``memo``: ``candidates`` are all the replicas in rotation (no
        retry excluded any), so what was computed for them may be reused."""
        raise NotImplementedError

    def routed(self, chains: Chains, replica: str) -> tuple[tuple[int, ...], int]:
        """The request is sent to ``replica``: the blocks it claims there and the count of
        claims withdrawn so far (``Decision.claimed``, ``Decision.withdrawals``)."""
        return (), 0

    def finished(self, decision: Decision, *, ok: bool) -> None:
        """The request ended: well (``ok``) or not."""

    def added(self, replica: str) -> None:
        """``replica`` joined the fleet (new: its cache is empty)."""

    def removed(self, replica: str) -> None:
        """``replica`` left the fleet."""

    def availability_changed(self, replica: str) -> None:
        """``replica`` went out of rotation or came back (it keeps its cache)."""

    @property
    def tracked_blocks(self) -> int:
        """Prefix blocks the policy tracks (for ``/metrics``)."""
        return 0

    @property
    def evictions(self) -> int:
        """Blocks forgotten to stay within the policy's cap."""
        return 0
