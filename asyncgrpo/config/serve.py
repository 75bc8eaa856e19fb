"""Settings of local vLLM replicas and the exact command line and environment they get."""

from __future__ import annotations

import bisect
import ipaddress
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

from asyncgrpo.config.coerce import check_fields
from asyncgrpo.config.redaction import redact_text, redacted_repr
from asyncgrpo.config.sources import env_name
from asyncgrpo.config.store import FetchLimits
from asyncgrpo.errors import ConfigError

_LIMITS = FetchLimits()

#: Transport roots a replica may fetch adapters from (comma-separated URLs or paths).
TRANSPORTS_ENV = "ASYNCGRPO_ADAPTER_TRANSPORTS"
#: Directory under which the replica makes its adapter cache (default: the system temp dir).
CACHE_DIR_ENV = "ASYNCGRPO_ADAPTER_CACHE_DIR"
#: ``ASYNCGRPO_ADAPTER_MAX_MANIFEST_BYTES``, ``..._MAX_FILES``, ``..._MAX_TOTAL_BYTES``:
#: the replica's :class:`FetchLimits`.
LIMITS_ENV_PREFIX = "ASYNCGRPO_ADAPTER_"

#: The ``vllm.endpoint_plugins`` entry point name of :mod:`asyncgrpo.serve.vllm_plugin`.
PLUGIN_NAME = "asyncgrpo"

#: vLLM accepts only these values for ``--max-lora-rank``.
ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def round_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank ``r``."""
    i = bisect.bisect_left(ALLOWED_LORA_RANKS, r)
    if r < 1 or i == len(ALLOWED_LORA_RANKS):
        raise ConfigError(f"LoRA rank {r} is outside vLLM's range 1..{ALLOWED_LORA_RANKS[-1]}")
    return ALLOWED_LORA_RANKS[i]


def is_loopback(host: str) -> bool:
    """True for hosts only this machine can reach (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AdapterDelivery = Literal["auto", "path", "fetch"]


@dataclass(kw_only=True)
class ServeConfig:
    """How to start local vLLM replicas: ``python -m asyncgrpo.serve`` and a run's ``serve``.

    In a training config, ``model``, ``lora_rank`` and ``max_staleness`` come from ``model``,
    ``lora.r`` and ``trainer.max_staleness`` (``derived``), so they cannot disagree with the
    trainer.
    """

    model: str = field(default="", metadata={"required": True, "derived": "model"})
    """Model directory (or Hugging Face id) to serve."""
    replicas: int = 1
    """Local vLLM replicas to start (in a run, 0: only proxy.upstreams)."""
    host: str = "127.0.0.1"
    """Address the replicas bind."""
    port: int | None = None
    """First port (replica i gets port+i); None: free ports."""
    lora_rank: int = field(default=8, metadata={"derived": "lora.r"})
    """Largest adapter rank to serve; rounded up to vLLM's set."""
    max_staleness: int = field(default=4, metadata={"derived": "trainer.max_staleness"})
    """Adapter versions kept besides the newest (sizes --max-loras)."""
    runs: int = 1
    """Training runs these replicas serve at once (a sweep, several teams), each keeping up to
    max_staleness + 2 adapter versions loaded (load before unload): sizes --max-loras."""
    pinned_versions: int = field(default=0, metadata={"derived": "eval.every"})
    """Adapter versions an evaluation keeps loaded past the staleness window (one while an
    in-training evaluation runs on it): added to --max-loras."""
    max_loras: int | None = None
    """LoRA slots; None: runs x (max_staleness + 2) + pinned_versions."""
    dtype: Dtype = "auto"
    """vLLM --dtype; float32 on CPU gives logprobs equal to the trainer's."""
    max_model_len: int | None = None
    """vLLM --max-model-len; None: the model's."""
    kv_cache_gib: int | None = None
    """CPU KV cache per replica in whole GiB (VLLM_CPU_KVCACHE_SPACE). None on a CPU host: sized
    from the available memory and the replica count."""
    spread_cpu_cores: bool = True
    """CPU hosts: bind replica i's OpenMP threads to core i mod N. vLLM's 'auto' binds every
    replica to the same cores; ignored when VLLM_CPU_OMP_THREADS_BIND is set."""
    nice: int = 0
    """Nice value (0-19) of the replicas. vLLM's workers busy-poll for a second after every
    batch; on a host where the trainer computes too, use ~10 so that polling does not take the
    cores the trainer needs."""
    gpu_memory_utilization: float | None = None
    """vLLM --gpu-memory-utilization on GPU hosts."""
    api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    """vLLM --api-key; required when host is not loopback."""
    extra_args: list[str] = field(default_factory=list, metadata={"argv_rest": True})
    """After --: more vLLM flags, passed through verbatim."""
    startup_timeout_s: float = 600.0
    """Seconds to wait for each replica's /health."""
    log_dir: str | None = None
    """Directory of the replica logs (kept after exit). None: a new directory under
    ~/.cache/asyncgrpo/replica-logs (in a run: <run dir>/replica-logs)."""
    transports: tuple[str, ...] = field(default=(), metadata={"derived": "transport_url"})
    """Transport roots (s3://bucket/prefix, hf://buckets/..., a directory) the replicas may
    fetch adapter versions from themselves; each replica fetches into its own cache and verifies
    every sha256. Credentials come from the replica's environment."""
    adapter_cache_dir: str | None = None
    """Where each replica makes its private adapter cache (a new 0700 directory per replica
    process, removed at exit); None: the system temp directory."""
    adapter_max_total_bytes: int | None = _LIMITS.max_total_bytes
    """Largest adapter version a replica fetches (the sum of its manifest's file sizes, in
    bytes), refused before any download; None: no cap. Each file is read no further than the
    size its manifest declares."""
    adapter_max_files: int = _LIMITS.max_files
    """Most files one adapter version may list."""
    adapter_max_manifest_bytes: int = _LIMITS.max_manifest_bytes
    """Largest adapter manifest a replica reads, in bytes."""
    adapter_delivery: AdapterDelivery = field(default="auto", metadata={"cli": False})
    """A run's: how replicas get each adapter version. 'fetch': the trainer sends a transport
    reference and every replica fetches and verifies the version itself (replicas on other
    machines; needs asyncgrpo's vLLM plugin, which `python -m asyncgrpo.serve --transport URL`
    enables). 'path': the trainer fetches it and sends a path on its own disk (replicas must see
    it). 'auto': fetch when proxy.upstreams lists replicas, path when all replicas are local."""

    __repr__ = redacted_repr  # transports may be URLs with credentials (a SAS token)

    def __post_init__(self) -> None:
        check_fields(
            self,
            "serve",
            ge={
                "replicas": 0,
                "runs": 1,
                "max_staleness": 0,
                "nice": 0,
                "port": 1,
                "max_model_len": 1,
                "kv_cache_gib": 1,
                "pinned_versions": 0,
                "adapter_max_total_bytes": 1,
                "adapter_max_files": 1,
                "adapter_max_manifest_bytes": 1,
            },
            le={"nice": 19, "port": 65535},
            gt={"startup_timeout_s": 0, "gpu_memory_utilization": 0},
        )
        need = self.max_staleness + 2 + self.pinned_versions
        if self.max_loras is not None and self.max_loras < need:
            raise ConfigError(
                f"serve.max_loras={self.max_loras} < max_staleness + 2 + pinned_versions = "
                f"{need}: the sync loads the new version before unloading the oldest (and an "
                "evaluation keeps its version), and vLLM would silently evict a policy with "
                "requests still in flight; raise max_loras"
            )
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(
                f"serve.host={self.host!r} is not loopback: set serve.api_key (CLI: export "
                "ASYNCGRPO_SERVE_API_KEY) so the replicas refuse unauthenticated requests"
            )
        round_lora_rank(self.lora_rank)
        self.transports = tuple(self.transports)
        for url in self.transports:
            if not isinstance(url, str) or not url or "," in url:
                raise ConfigError(
                    f"serve.transports: {redact_text(repr(url))} must be a transport URL or "
                    "path without ','"
                )

    def delivery(self, *, remote_replicas: bool) -> Literal["path", "fetch"]:
        """The delivery a run uses (``auto`` resolved by whether it has remote replicas)."""
        if self.adapter_delivery != "auto":
            return self.adapter_delivery
        return "fetch" if remote_replicas else "path"

    @property
    def lora_slots(self) -> int:
        if self.max_loras is not None:
            return self.max_loras
        return self.runs * (self.max_staleness + 2) + self.pinned_versions

    def command(self, port: int) -> list[str]:
        """The replica's argv. ``python -m``: the ``vllm`` console script fails under vllm-cpu."""
        if not self.model:
            raise ConfigError("serve.model is empty: give the model directory (--model DIR)")
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(port),
            "--enable-lora",
            "--max-lora-rank", str(round_lora_rank(self.lora_rank)),
            "--max-loras", str(self.lora_slots),
            "--logprobs-mode", "processed_logprobs",
            "--dtype", self.dtype,
        ]  # fmt: skip
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return argv + list(self.extra_args)

    def env(self, index: int = 0) -> dict[str, str]:
        """Replica ``index``'s environment: runtime LoRA endpoints, dev-mode pause/resume/
        server_info, and on CPU hosts its own core."""
        env = dict(os.environ)
        if self.spread_cpu_cores and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])
        threads = in_process_omp_threads(env)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gib))
        # The adapter-fetching endpoint plugin (vLLM loads endpoint plugins only when named).
        plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
        if PLUGIN_NAME not in plugins:
            env["VLLM_PLUGINS"] = ",".join([*plugins, PLUGIN_NAME])
        if self.transports:
            env[TRANSPORTS_ENV] = ",".join(self.transports)
        if self.adapter_cache_dir is not None:
            env[CACHE_DIR_ENV] = self.adapter_cache_dir
        for name in ("max_total_bytes", "max_files", "max_manifest_bytes"):
            value = getattr(self, f"adapter_{name}")
            env[env_name(LIMITS_ENV_PREFIX, name)] = "none" if value is None else str(value)
        if self.api_key:
            # Passed by environment, not argv, so it never shows in `ps` or our logs.
            env["VLLM_API_KEY"] = self.api_key
        return env


def in_process_omp_threads(env: dict[str, str]) -> int | None:
    """OpenMP threads for a replica whose engine core runs the model itself, or None to leave.

    Without multiprocessing (``VLLM_ENABLE_V1_MULTIPROCESSING`` off) vLLM starts no worker
    process, so the thread binding it applies there (``VLLM_CPU_OMP_THREADS_BIND``) never
    happens and the engine core keeps an OpenMP thread per core. Two such replicas beside a
    trainer then spin on each other's cores, several times slower (docs/testing.md). The bound
    core list's size is the thread count vLLM's worker would have used.
    """
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" or "OMP_NUM_THREADS" in env:
        return None
    cores = 0
    for part in env.get("VLLM_CPU_OMP_THREADS_BIND", "").split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            return None  # 'auto', 'nobind', per-rank '|' lists: vLLM's own choice stands
        span = int(last) - int(first) + 1 if dash else 1
        if span < 1:
            return None
        cores += span
    return cores or None
