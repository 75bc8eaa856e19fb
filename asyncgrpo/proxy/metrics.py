"""``/metrics`` in Prometheus text format (``prometheus_client``'s exposition, from a collector
over the live state: nothing is counted twice) and ``/proxy/stats`` as JSON."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from asyncgrpo.proxy.runs import OVERFLOW
from asyncgrpo.proxy.state import Proxy
from asyncgrpo.proxy.upstream import Circuit

__all__ = ["CONTENT_TYPE_LATEST", "fleet_json", "render", "runs_stats", "stats_json"]

_P = "asyncgrpo_proxy_"
_KIND = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
#: (name, kind, help, label names, [(label values, value)])
_Family = tuple[str, str, str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]


def render(proxy: Proxy) -> bytes:
    registry = CollectorRegistry()
    registry.register(_Collector(proxy))
    return generate_latest(registry)


class _Collector(Collector):
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def collect(self) -> Iterator[Metric]:
        proxy = self.proxy
        for name, kind, help_, labels, samples in _families(proxy):
            family = _KIND[kind](_P + name, help_, labels=labels)
            for values, value in samples:
                family.add_metric(values, value)
            yield family
        stats = proxy.stats
        yield SummaryMetricFamily(
            _P + "route_seconds",
            "Time spent hashing prompts and choosing a replica.",
            count_value=stats.route_count,
            sum_value=stats.route_seconds,
        )


def _families(proxy: Proxy) -> list[_Family]:
    """Per replica, per fleet and per training run (label ``run``: a model less its ``-v<N>``)."""
    router, stats, fleet = proxy.router, proxy.stats, proxy.pool.fleet
    ups = list(proxy.pool.upstreams.values())
    runs = list(proxy.runs.runs.values())
    r = ("replica",)
    return [
        ("routed_total", "counter", "Generation requests routed to a replica.",
         r, [((u.url,), u.routed) for u in ups]),
        ("inflight", "gauge", "Routed generation requests in flight on a replica.",
         r, [((u.url,), router.inflight(u.url)) for u in ups]),
        ("failures_total", "counter",
         "Upstream failures by kind (connect, deadline, disconnect, http_5xx, health, broadcast).",
         ("replica", "kind"), [((u.url, k), n) for u in ups for k, n in sorted(u.failures.items())]),
        ("replica_healthy", "gauge", "1 while the replica is in rotation (circuit closed).",
         r, [((u.url,), int(u.circuit is Circuit.CLOSED)) for u in ups]),
        ("replicas_in_rotation", "gauge", "Replicas in the fleet (taking requests, broadcasts).",
         (), [((), sum(u.serving for u in ups))]),
        ("fleet_changes_total", "counter",
         "Replicas that joined (added at run time), rejoined (back after leaving) or left.",
         ("change",), [((k,), fleet[k]) for k in ("joins", "rejoins", "left")]),
        ("catch_ups_total", "counter",
         "Adapter replays that brought a joining or returning replica up to date, by outcome.",
         ("outcome",), [(("ok",), fleet["replays"]), (("failed",), fleet["replay_failures"])]),
        ("lost_requests_total", "counter",
         "Generation tries that failed on a replica (redone on another while attempts last).",
         (), [((), stats.lost_requests)]),
        ("lost_generation_seconds_total", "counter",
         "Time those tries had run before they failed: generation lost to failures.",
         (), [((), round(stats.lost_seconds, 3))]),
        ("route_decisions_total", "counter", "Routing decisions by kind.",
         ("kind",), [((k,), n) for k, n in router.decisions.items()]),
        ("tracked_blocks", "gauge", "Prefix blocks the router tracks.",
         (), [((), router.tracked_blocks)]),
        ("tracked_sessions", "gauge", "Sessions (X-Session-ID) the router remembers.",
         (), [((), router.tracked_sessions)]),
        ("session_moves_total", "counter",
         "Requests of a known session sent to another replica (its own gone, busy or failed).",
         (), [((), router.session_moves)]),
        ("block_evictions_total", "counter", "Prefix blocks dropped by the LRU cap.",
         (), [((), router.evictions)]),
        ("retries_total", "counter", "Requests retried on another replica.",
         (), [((), stats.retries)]),
        ("rejected_total", "counter", "Requests answered by the proxy itself with an error.",
         ("status",), [((str(s),), n) for s, n in sorted(stats.rejected.items())]),
        ("broadcasts_total", "counter", "Broadcast control calls by endpoint and outcome.",
         ("endpoint", "outcome"), [((e, o), n) for (e, o), n in sorted(stats.broadcasts.items())]),
        ("adapters_loaded", "gauge", "Adapters loaded through the proxy.",
         (), [((), len(proxy.pool.adapters))]),
        ("run_requests_total", "counter", "Generation requests of a run.",
         ("run",), [((x.name,), x.requests) for x in runs]),
        ("run_sequences_total", "counter", "Sequences a run asked for (n per prompt).",
         ("run",), [((x.name,), x.sequences) for x in runs]),
        ("run_inflight", "gauge", "A run's sequences in flight on the replicas.",
         ("run",), [((x.name,), x.inflight) for x in runs]),
        ("run_waiting", "gauge", "A run's requests waiting for its turn (replicas saturated).",
         ("run",), [((x.name,), len(x.queue)) for x in runs]),
        ("run_wait_seconds_total", "counter", "Time a run's requests waited for their turn.",
         ("run",), [((x.name,), x.waited_s) for x in runs]),
        ("run_sequence_seconds_total", "counter",
         "Sequence-seconds a run had in flight: its share of generation.",
         ("run",), [((x.name,), x.sequence_s) for x in runs]),
        ("run_weight", "gauge", "A run's weight in the fair share.",
         ("run",), [((x.name,), x.weight) for x in runs]),
        ("run_lora_slots", "gauge", "LoRA slots a registered run holds (max_staleness + 2).",
         ("run",), [((x.name,), x.slots) for x in runs if x.slots is not None]),
        ("runs_folded_total", "counter",
         f"Requests counted under run {OVERFLOW!r}: their run came past max_runs busy ones.",
         (), [((), proxy.runs.folded)]),
        ("share_capacity", "gauge",
         "Sequences in flight before requests wait for their run's turn (0: they never wait).",
         (), [((), proxy.runs.capacity or 0)]),
    ]  # fmt: skip


def runs_stats(proxy: Proxy) -> dict[str, Any]:
    """The runs, as ``/proxy/stats`` and ``GET /proxy/runs`` show them."""
    runs, now = proxy.runs, proxy.loop.time()
    return {
        "runs": {name: run.as_dict(now) for name, run in runs.runs.items()},
        "share": {"capacity": runs.capacity, "inflight": runs.inflight, "waiting": runs.waiting},
        "lora_slots_held": runs.holders(proxy.pool.adapters),
    }


def stats_json(proxy: Proxy) -> dict[str, Any]:
    router, pool, stats = proxy.router, proxy.pool, proxy.stats
    decisions = router.decisions
    total = sum(decisions.values()) or 1
    return {
        "block_size": pool.block_size,
        "routing": router.stats(),
        "fractions": {k: v / total for k, v in decisions.items()},
        "upstreams": [u.as_dict() for u in pool.upstreams.values()],
        "adapters": sorted(pool.adapters),
        "paused": pool.paused_query is not None,
        "retries": stats.retries,
        "fleet": fleet_json(proxy),
        "rejected": {str(k): v for k, v in stats.rejected.items()},
        "route_seconds_mean": stats.route_seconds / max(stats.route_count, 1),
        **runs_stats(proxy),
    }


def fleet_json(proxy: Proxy) -> dict[str, float]:
    """The fleet in numbers (also what a trainer logs as ``fleet/*``)."""
    pool, stats = proxy.pool, proxy.stats
    return {
        "replicas": len(pool.upstreams),
        "in_rotation": sum(u.serving for u in pool.upstreams.values()),
        **{f"{k}_total": pool.fleet[k] for k in ("joins", "rejoins", "left")},
        "catch_ups_total": pool.fleet["replays"],
        "catch_up_failures_total": pool.fleet["replay_failures"],
        "lost_requests_total": stats.lost_requests,
        "lost_generation_s_total": round(stats.lost_seconds, 3),
    }
