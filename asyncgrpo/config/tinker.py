"""Settings of the Tinker-compatible service: one keyword-only dataclass, every field a flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncgrpo.config.coerce import check_fields
from asyncgrpo.config.redaction import redacted_repr
from asyncgrpo.config.serve import is_loopback
from asyncgrpo.errors import ConfigError

__all__ = ["TinkerConfig"]

#: The variable the SDK reads its key from; the service reads the key it requires from it too.
API_KEY_ENV = "TINKER_API_KEY"
#: The prefix the SDK's ``ApiKeyAuthProvider`` insists on (it refuses any other key locally).
API_KEY_PREFIX = "tml-"


@dataclass(kw_only=True)
class TinkerConfig:
    """A REST server speaking the ``tinker`` SDK's API over asyncgrpo's trainer.

    Groups: the base model it trains (``model``, ``model_name``, ``dtype``, LoRA bounds); where
    it listens and who may talk to it (``host``, ``port``, ``api_key``).
    """

    model: str = field(default="", metadata={"required": True})
    """Directory (or Hugging Face id) of the base model every training client's LoRA is on."""
    model_name: str | None = None
    """The name clients pass as ``base_model``. None: ``model`` as given, so the SDK's
    ``get_tokenizer()`` loads the tokenizer from that directory, offline."""
    dtype: str = "auto"
    """Trainer dtype: auto (bfloat16 on a CUDA device that has it, else float32), float32,
    bfloat16 or float16; the replicas ``replicas`` starts serve at the dtype it resolves to."""
    max_lora_rank: int = 32
    """Largest LoRA rank a client may ask for; keep it at or below the replicas'
    ``--max-lora-rank`` so every adapter can be served."""
    lora_alpha: float = 32.0
    """lora_alpha of every client's adapter (the update is scaled by alpha/rank)."""
    max_context_length: int = 4096
    """Longest ``Datum`` (tokens) accepted, reported in the server capabilities."""
    token_budget: int = 4096
    """Tokens per packed forward: forward_backward packs a request's Datums into rows of at
    most this many tokens (a longer Datum gets a row of its own), one forward and backward per
    row. It bounds the trainer's activations and logits; without flash-attention (CPU) a
    row's attention costs the sum of its Datums' squares."""
    host: str = "127.0.0.1"
    """Interface to bind. Anything but loopback requires api_key."""
    port: int = 8000
    """Port to bind; 0 picks a free one (the ready line names it)."""
    api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    """Key every request must carry (the SDK sends TINKER_API_KEY as X-API-Key); it must start
    with 'tml-', the SDK's own rule. Required unless host is loopback. Never logged."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest forward_backward body (the SDK's protobuf). The SDK splits a batch into
    requests of at most max_datums Datums and about 5 MB (this service tells it so), so this
    bounds only a request of a few very long Datums; every other route takes a small JSON
    body (64 KiB; a sample request 64 KiB plus 32 bytes per token of max_context_length)."""
    max_datums: int = 1024
    """Most Datums in one forward_backward request (the SDK splits larger batches); a Datum
    with no tokens is refused."""
    max_queued_per_client: int = 64
    """Requests of one training client queued at once; one more is answered 429, which the
    SDK retries after a pause."""
    max_connections: int = 1024
    """Client connections open at once, at most (lowered to fit the open-file limit). At the
    cap, a new connection closes the ones that waited longest without a request in progress
    (those that never sent one first); if all are busy it is answered 503."""
    head_timeout_s: float = 10.0
    """A client must send a request's whole head within this many seconds of connecting or of
    the request's first byte, else the connection is closed."""
    client_idle_timeout_s: float = 75.0
    """A connection idle this long between requests is closed, and a request whose body takes
    longer than this to arrive is answered 408."""
    proxy_url: str | None = None
    """The asyncgrpo proxy in front of the vLLM replicas that sample (they serve ``model``).
    None: no sampling; save_weights_for_sampler and sample are refused."""
    replicas: int = 0
    """vLLM replicas of ``model`` the service starts itself, behind a proxy of its own in this
    process (the fleet starter ``asyncgrpo train`` uses); stopped when the service stops."""
    upstreams: tuple[str, ...] = ()
    """vLLM replicas elsewhere (``--upstream URL``, repeatable) behind the service's own proxy,
    beside any it starts. Give these or ``replicas``, or ``proxy_url``, not both."""
    kv_cache_gib: int | None = None
    """The started replicas' CPU KV cache in whole GiB each. None: sized from free memory."""
    max_model_len: int | None = None
    """The started replicas' --max-model-len. None: the model's."""
    max_loras: int | None = None
    """The started replicas' LoRA slots. None: two sampling clients' worth,
    2 x (sampler_keep + 1); a client beyond them waits for the slots of sessions that stopped
    heartbeating, or is refused naming --max-loras."""
    proxy_admin_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    """The proxy's admin key, which adapter loads and LoRA-slot bookings take. Never logged."""
    transport_url: str = field(default="", metadata={"flag": "--transport"})
    """Transport URL (a directory, s3://, gs://, ...) sampler weights and save_state
    checkpoints are published to, and replicas elsewhere fetch adapters from. Empty:
    ``work_dir``/store."""
    adapter_delivery: Literal["auto", "fetch", "path"] = "auto"
    """How replicas get each sampler version. 'fetch': a reference into the transport that
    every replica fetches and verifies itself (replicas anywhere; they run asyncgrpo's vLLM
    plugin, `python -m asyncgrpo.serve --transport URL`); refused at start when a replica may
    not. 'path': a copy on this host's disk (replicas share this filesystem). 'auto': fetch
    when every replica may fetch from the transport, else path."""
    work_dir: str = "runs/tinker"
    """Directory for the service's own files (saved adapters, the replicas' local copies)."""
    sampler_keep: int = 2
    """Versions of each client's sampler weights kept loaded on the replicas; each client books
    sampler_keep + 1 LoRA slots (the replicas' --max-loras bounds the clients sampling at once).
    Sampling an older version loads it back from the transport into the spare slot, in place
    of the one loaded back before."""
    session_timeout_s: float = 30.0
    """A session with neither a heartbeat nor a request for this long expires: its training
    clients end (adapters, optimizer state, queued requests and LoRA slots released). The SDK
    heartbeats every 10 s from a thread of its own, so 30 s is three missed heartbeats: a
    program that ended without closing its ServiceClient frees its slots within about 30 s,
    and a client that needs slots meanwhile waits for them. Raise it on a flaky network."""
    max_training_clients: int = 16
    """The most training clients alive at once (each holds an adapter and its AdamW state in
    the trainer's memory); one more is refused naming this cap."""
    dp_timeout_s: float = 1800.0
    """Under torchrun (several ranks): how long a rank waits for the others in one operation
    before the service fails naming it (RankError). Rank 0 pings idle ranks every
    min(60, dp_timeout_s / 4) s, so an idle service does not run out of it."""

    __repr__ = redacted_repr  # the generated repr would print credentials in transport_url

    def __post_init__(self) -> None:
        check_fields(
            self,
            "tinker",
            ge={
                "max_lora_rank": 1,
                "max_context_length": 2,
                "port": 0,
                "token_budget": 1,
                "max_body_bytes": 1024,
                "sampler_keep": 1,
                "max_training_clients": 1,
                "max_datums": 1,
                "max_queued_per_client": 1,
                "max_connections": 1,
                "replicas": 0,
                "kv_cache_gib": 1,
                "max_model_len": 1,
                "max_loras": 1,
            },
            le={"port": 65535},
            gt={
                "lora_alpha": 0,
                "session_timeout_s": 0,
                "dp_timeout_s": 0,
                "head_timeout_s": 0,
                "client_idle_timeout_s": 0,
            },
        )
        if not self.model:
            raise ConfigError("tinker.model is empty: give the base model's directory (--model)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"tinker.dtype={self.dtype!r}: use auto, float32, bfloat16 or float16"
            )
        if self.adapter_delivery not in ("auto", "fetch", "path"):
            raise ConfigError(
                f"tinker.adapter_delivery={self.adapter_delivery!r}: use auto, fetch or path"
            )
        if self.proxy_url and (self.replicas or self.upstreams):
            raise ConfigError(
                "tinker.proxy_url and tinker.replicas/upstreams both given: sample through the "
                "proxy at --proxy-url, or let the service start its own (--replicas N, "
                "--upstream URL), not both"
            )
        if self.api_key is not None and not self.api_key.startswith(API_KEY_PREFIX):
            raise ConfigError(
                f"{API_KEY_ENV} must start with {API_KEY_PREFIX!r} (the tinker SDK refuses "
                "any other key before sending it)"
            )
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(
                f"tinker.host={self.host!r} is reachable from other machines: set "
                f"{API_KEY_ENV} (a key starting with {API_KEY_PREFIX!r}) or bind 127.0.0.1"
            )

    @property
    def served_name(self) -> str:
        """The ``base_model`` name clients use."""
        return self.model_name or self.model
