"""``routing="round_robin"``: each request to the next replica in turn, prompts and sessions
ignored (the baseline the routing benchmark compares against)."""

from __future__ import annotations

from asyncgrpo.proxy.policies.base import Chains, DecisionKind, Fleet, RoutingPolicy

__all__ = ["RoundRobin"]


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def choose(
        self, fleet: Fleet, chains: Chains, candidates: list[str], *, memo: bool
    ) -> tuple[str | None, DecisionKind, int]:
        return fleet.next_in_turn(candidates), "unmatched", 0
