"""Proxy settings: one keyword-only dataclass, embedded as-is in the training config."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from asyncgrpo.config.coerce import check_fields
from asyncgrpo.config.redaction import redact_url
from asyncgrpo.config.serve import is_loopback
from asyncgrpo.errors import ConfigError

__all__ = ["ROUTING_POLICIES", "ProxyConfig", "is_loopback", "token_allowed"]

#: The routing policies by the name ``ProxyConfig.routing`` takes: the class that implements
#: each, as ``module:Class`` (imported only by a proxy that uses it). A new policy is a module in
#: ``asyncgrpo/proxy/policies/`` and an entry here. The baseline comes first: the routing
#: benchmark runs them in this order.
ROUTING_POLICIES = {
    "round_robin": "asyncgrpo.proxy.policies.round_robin:RoundRobin",
    "affinity": "asyncgrpo.proxy.policies.affinity:PrefixAffinity",
}
Routing = Literal[tuple(ROUTING_POLICIES)]  # type: ignore[valid-type]


def split_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path prefix)`` of a replica's base URL; ValueError says why not."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = -1
    if not url.isascii() or u.scheme not in ("http", "https") or not u.hostname or port == -1:
        raise ValueError(f"{redact_url(url)!r} is not an http(s)://HOST[:PORT] URL")
    if u.username is not None or u.query or u.fragment:
        raise ValueError(
            f"{redact_url(url)!r}: no credentials, query or fragment in a replica's URL"
        )
    return u.scheme, u.hostname, port or (443 if u.scheme == "https" else 80), u.path.rstrip("/")


@dataclass(kw_only=True)
class ProxyConfig:
    """One endpoint in front of many vLLM replicas.

    Groups: where it listens and who may talk to it (``host``, ``port``, ``api_key``,
    ``admin_api_key``, ``max_body_bytes``, ``lora_roots``, connection limits); where it sends
    (``upstreams``, ``upstream_api_key``, ``upstream_key_urls``);
    routing (``routing``, ``block_size``, ``imbalance``, ``max_tracked_blocks``); failure handling
    (timeouts, circuit breaker, retries); adapter broadcast (``load_deadline_s``, ...).
    """

    upstreams: tuple[str, ...] = ()
    """Base URLs of the vLLM replicas, e.g. http://10.0.0.2:8000."""
    host: str = "127.0.0.1"
    """Interface to bind. Anything but loopback requires api_key."""
    port: int = 8000
    """Port to bind; 0 picks a free one."""
    api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    """Bearer token clients must send. Never logged."""
    admin_api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    """Bearer token of the admin routes (POST and DELETE /proxy/upstreams: add, remove replicas),
    instead of api_key. None: those routes answer 403. Never logged."""
    upstream_api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    """Bearer token sent to every upstream (e.g. HF_TOKEN for a Hugging Face Job's exposed port,
    or vLLM's --api-key). Never logged."""
    upstream_key_urls: tuple[str, ...] = ()
    """Origins (scheme://host[:port]; the host may start with '*.', e.g. https://*.hf.space, or
    be '*', any host on that port: machines whose addresses nobody knows in advance) of
    replicas added at run time (POST /proxy/upstreams) that get upstream_api_key; any other
    gets no token. The upstreams given at start always get it."""
    lora_roots: tuple[str, ...] = ()
    """Absolute directories a /v1/load_lora_adapter lora_path must lie under. Empty: any
    absolute path without '..' (only sensible on loopback)."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body accepted (413 above)."""
    routing: Routing = "affinity"
    """The routing policy (ROUTING_POLICIES): 'affinity', KV-prefix aware; 'round_robin', the
    baseline the routing benchmark compares against."""
    block_size: int | None = None
    """KV block size in tokens. None: read vllm_config.cache_config.block_size from the
    replicas' /server_info (16 on GPU, 128 on CPU)."""
    imbalance: int = 8
    """How many more in-flight requests than the least-loaded replica the prefix owner may have
    and still get the request; beyond that it spills."""
    imbalance_ratio: float = 1.5
    """The owner also keeps the request while its in-flight count is at most this multiple of
    the least-loaded replica's (relative bound for heavy load)."""
    max_tracked_blocks: int = 1_000_000
    """LRU cap on tracked prefix blocks (about 150 bytes each)."""
    connect_timeout_s: float = 3.0
    """Connecting to a replica; a refused/slow connect retries."""
    request_timeout_s: float = 600.0
    """Deadline for a replica to answer a non-streaming request (or send the first chunk of a
    stream). On expiry the replica leaves rotation and the request is retried elsewhere: catches
    a replica whose engine stopped while its HTTP server lingers. Checked every 0.1 s."""
    stream_idle_timeout_s: float = 120.0
    """Largest gap between two chunks of a streamed answer."""
    client_idle_timeout_s: float = 75.0
    """A client connection idle this long between requests, or this slow to send a request's
    body after its head, is closed."""
    head_timeout_s: float = 10.0
    """A client must send a request's whole head within this many seconds of connecting or of
    the request's first byte, else the connection is closed."""
    max_connections: int = 4096
    """Client connections open at once, at most (lowered to fit the open-file limit). At the
    cap, a new connection closes the ones that waited longest without a request in progress
    (those that never sent one first)."""
    max_inflight_per_replica: int | None = None
    """Sequences in flight per replica (a request counts n per prompt) beyond which generation
    requests wait in the proxy, and each freed place goes to the run furthest below its weighted
    share (runs: a request's model less its -v<N>). None: the replicas' --max-num-seqs (from
    /server_info), beyond which vLLM would queue them itself, first come first served; 0:
    requests never wait here."""
    queue_timeout_s: float = 600.0
    """A generation request waiting for its run's turn (replicas saturated) this long gets 503:
    no client can hold its place, and a connection, for ever."""
    max_queued_per_run: int = 4096
    """Requests of one run waiting for its turn, at most; one more gets 429. At the connection
    cap, with no idle connection to close, the longest-waiting requests of the run with the
    most waiting are answered 503 and their connections closed to make room."""
    max_runs: int = 1024
    """Runs (distinct models less their -v<N>) the proxy keeps figures for, at most; beyond,
    the longest silent idle one is forgotten, or (all busy or registered) the request counts
    under run "(other)", and a registration is refused. Bounds memory and /metrics."""
    max_buffered_bytes: int = 2 * 1024**3
    """Request bodies the proxy holds at once (being received, queued, waiting their turn, in
    flight), bytes, at most; a body that would go past gets 503."""
    offload_body_bytes: int = 1024 * 1024
    """Generation bodies above this size are decoded and hashed for routing in a worker
    process, not on the event loop: a 32 MiB body takes seconds there, while every other
    client waits. 0: all bodies."""
    run_lease_s: float = 3600.0
    """A run registered through POST /proxy/runs (its LoRA slots, its weight) that sends no
    request for this long loses its registration: a run that died without releasing it."""
    max_attempts: int = 3
    """Tries per request across replicas (connect errors and deadlines)."""
    health_interval_s: float = 2.0
    """Period of the background GET /health on every replica."""
    health_timeout_s: float = 5.0
    """A health check slower than this counts as a failure."""
    min_healthy_replicas: int = 1
    """The proxy's own /health answers 200 while at least this many replicas serve (in rotation
    and answering their /health), 503 below; the body lists the replicas that do not. What a
    caller in front of the proxy (a load balancer, another proxy) needs: the fleet can take
    requests, even with a member lost."""
    health_timeouts_to_open: int = 3
    """Consecutive health checks that time out before a replica leaves rotation (a refused
    connection or a 5xx takes it out at once): a busy replica answers late."""
    circuit_open_s: float = 1.0
    """How long a failed replica stays out before a half-open probe; doubles on each consecutive
    failure, up to 30 s."""
    load_deadline_s: float = 60.0
    """How long a /v1/load_lora_adapter keeps retrying a replica that answers 'No adapter found'
    (storage lag) before the proxy returns 504."""
    load_retry_interval_s: float = 0.5
    """Pause between retries of a lagging adapter load."""
    broadcast_timeout_s: float = 60.0
    """Deadline for one replica to answer a broadcast call (load, pause...)."""

    def __post_init__(self) -> None:
        self.upstreams = tuple(u.rstrip("/") for u in self.upstreams)
        self.lora_roots = tuple(self.lora_roots)
        self.upstream_key_urls = tuple(u.rstrip("/") for u in self.upstream_key_urls)
        for name in ("upstreams", "upstream_key_urls"):
            for u in getattr(self, name):
                try:
                    path = split_url(u)[3]
                except ValueError as exc:
                    raise ConfigError(f"{name}: {exc}; write http://HOST:PORT") from None
                if path and name == "upstream_key_urls":
                    raise ConfigError(f"{name}: {u!r} has a path; write scheme://HOST[:PORT]")
        for name in ("api_key", "admin_api_key", "upstream_api_key"):
            value = getattr(self, name)
            if value is not None and (not value.isprintable() or " " in value):
                raise ConfigError(f"proxy.{name}: a space or control character in the secret")
        if len(set(self.upstreams)) != len(self.upstreams):
            raise ConfigError("upstreams: the same URL is listed twice; list each replica once")
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(
                f"host={self.host!r} is reachable from other machines: set api_key "
                "(CLI: export ASYNCGRPO_PROXY_API_KEY) or bind host=127.0.0.1"
            )
        for root in self.lora_roots:
            if not posixpath.isabs(root) or ".." in root.split("/"):
                raise ConfigError(f"lora_roots: {root!r} must be an absolute path without '..'")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ConfigError(
                f"proxy.max_buffered_bytes={self.max_buffered_bytes} is below max_body_bytes="
                f"{self.max_body_bytes}: the largest body could never be held"
            )
        seconds = [n for n in self.__dataclass_fields__ if n.endswith("_s")]
        check_fields(
            self,
            "proxy",
            gt=dict.fromkeys(seconds, 0),
            le={"port": 65535},
            ge={
                "port": 0,
                "block_size": 1,
                "imbalance": 0,
                "imbalance_ratio": 1,
                "max_tracked_blocks": 1,
                "max_body_bytes": 1024,
                "health_timeouts_to_open": 1,
                "min_healthy_replicas": 0,
                "max_attempts": 1,
                "max_connections": 1,
                "max_inflight_per_replica": 0,
                "max_queued_per_run": 1,
                "max_runs": 1,
                "offload_body_bytes": 0,
            },
        )


def token_allowed(url: str, config: ProxyConfig) -> bool:
    """Whether a replica added at run time at ``url`` may get ``upstream_api_key``: its scheme,
    host and port match an entry of ``upstream_key_urls`` (``*.`` matching any subdomain, a
    host ``*`` any host)."""
    try:
        scheme, host, port, _ = split_url(url)
    except ValueError:
        return False
    for entry in config.upstream_key_urls:
        s, h, p, _ = split_url(entry)
        if (s, p) == (scheme, port) and (
            h in (host, "*") or (h[:2] == "*." and host.endswith(h[1:]))
        ):
            return True
    return False
