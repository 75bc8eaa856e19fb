"""The asyncgrpo proxy's own routes, beside the vLLM ones it relays or broadcasts: what the
proxy answers and its admin client asks, named once."""

from __future__ import annotations

#: The replicas: list, add, remove (admin routes but for GET).
UPSTREAMS_PATH = "/proxy/upstreams"
#: The book of the runs sharing the replicas (their LoRA slots and weights).
RUNS_PATH = "/proxy/runs"
#: The proxy's counters, the fleet's among them.
STATS_PATH = "/proxy/stats"
