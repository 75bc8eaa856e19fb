"""Prometheus ``/metrics`` read with ``prometheus_client``'s parser: the proxy's own counters, and
vLLM's prefix-cache counters (the independent measure of how well routing reuses KV)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.vllm.client import VLLMClient

__all__ = ["prefix_cache", "samples"]


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, keyed ``name{label="value",...}`` (labels
    sorted; no braces without labels). Raises ValueError on text that is not the format."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


async def prefix_cache(urls: list[str]) -> tuple[float, float]:
    """Sum of ``vllm:prefix_cache_hits_total`` and ``_queries_total`` over the replicas
    (ReplicaHTTPError if one answers ``/metrics`` with an error)."""
    hits = queries = 0.0
    for url in urls:
        async with VLLMClient(url, timeout_s=300) as client:  # aiohttp's default timeout
            text = await client.metrics_text()
        for key, value in samples(text).items():
            name = key.partition("{")[0]
            if name == "vllm:prefix_cache_hits_total":
                hits += value
            elif name == "vllm:prefix_cache_queries_total":
                queries += value
    return hits, queries
