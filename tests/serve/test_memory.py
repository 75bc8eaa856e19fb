"""KV cache sizing for CPU hosts when no size is given."""

from __future__ import annotations

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.serve import ServeConfig, memory
from asyncgrpo.serve.memory import MAX_KV_CACHE_GIB, kv_cache_gib_for, with_kv_cache_size


@pytest.mark.parametrize(
    ("replicas", "available", "weights", "expected"),
    [
        (2, 7.1, 0.0, 1),  # this project's machine: NUMA node 0 has ~7 GiB available
        (2, 10.0, 0.0, 2),  # (10 - 2) / 2 / 2
        (1, 64.0, 0.0, MAX_KV_CACHE_GIB),  # capped
        (2, 4.0, 0.0, 1),  # only the whole share reaches 1 GiB
        (2, 3.5, 0.0, 0),  # not even 1 GiB each: refuse
        (1, 6.0, 3.0, 1),  # weights count
    ],
)
def test_kv_cache_size_from_available_memory(replicas, available, weights, expected) -> None:
    assert kv_cache_gib_for(replicas, available, weights) == expected


def test_missing_size_is_chosen_or_refused_naming_the_flag(monkeypatch, caplog) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(memory, "is_cpu_host", lambda: True)
    monkeypatch.setattr(memory, "available_memory_gib", lambda: 16.0)
    chosen = with_kv_cache_size(ServeConfig(model="m", replicas=2))
    assert chosen.kv_cache_gib == 2 and chosen.env()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "giving each of 2 replica(s) 2 GiB" in caplog.text
    assert with_kv_cache_size(ServeConfig(model="m", kv_cache_gib=1)).kv_cache_gib == 1
    monkeypatch.setattr(memory, "available_memory_gib", lambda: 2.0)
    with pytest.raises(ConfigError, match="--kv-cache-gib"):
        with_kv_cache_size(ServeConfig(model="m", replicas=2))
    monkeypatch.setattr(memory, "is_cpu_host", lambda: False)  # GPU: vLLM sizes it itself
    assert with_kv_cache_size(ServeConfig(model="m", replicas=2)).kv_cache_gib is None


def test_available_memory_is_a_positive_number_here() -> None:
    assert 0 < memory.available_memory_gib() < 1 << 20
