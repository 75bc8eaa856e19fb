"""vLLM's own prefix-cache counters: the independent measure of how well routing reuses KV."""

from __future__ import annotations

import re

import aiohttp

_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


async def prefix_cache(urls: list[str]) -> tuple[float, float]:
    """Sum of ``vllm:prefix_cache_hits_total`` and ``_queries_total`` over the replicas."""
    hits = queries = 0.0
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            for name, value in _COUNTER.findall(text):
                if name == "hits":
                    hits += float(value)
                else:
                    queries += float(value)
    return hits, queries
