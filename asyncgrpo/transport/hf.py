"""Hugging Face Storage Buckets, through the buckets' S3-compatible gateway.

``hf://buckets/<namespace>/<bucket>[/prefix]`` becomes an :class:`~.s3.S3Transport` on
``https://s3.hf.co/<namespace>`` (path-style addressing, region ``us-east-1``), authenticated with
the S3 credentials Hugging Face derives from a user access token (``HFAK...``; generate them on
the token's menu at huggingface.co/settings/tokens) taken from options or ``HF_S3_ACCESS_KEY_ID``
/ ``HF_S3_SECRET_ACCESS_KEY`` (falling back to ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``).

Why the gateway and not ``huggingface_hub``'s bucket API (``batch_bucket_files``,
``list_bucket_tree``, ``get_bucket_paths_info``, ``download_bucket_files`` in huggingface_hub 2.x):

* the API is synchronous and every write goes through the Xet content-addressed protocol (native
  ``hf_xet`` client, xorb and shard uploads, then an ndjson ``/batch`` commit). That means a
  thread pool per transport and a data plane we cannot run offline: only the JSON endpoints
  could be tested against a local server, never a full put/get round trip;
* ``/batch`` has no conditional create, so "exactly one publisher wins" would be
  check-then-write; S3 ``If-None-Match: *`` on the gateway is the only way to ask for it;
* the gateway is plain S3: obstore gives native async, streaming, multipart and retries, and the
  very same code is exercised by the conformance suite against a real S3 protocol server.

The price is one manual step (generating the S3 key pair from a token) instead of using
``HF_TOKEN`` directly. "Published" is still detected through the storage API (a manifest
written last), never by polling a FUSE mount, which caches misses for ~30 s.

Not verified offline: that the gateway honours ``If-None-Match: *`` (if it ignores it, a
create silently overwrites); the live test (``tests/transport/test_hf_live.py``) checks it.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from asyncgrpo.config.redaction import redact_url
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport.objectstore import TUNING_OPTIONS, tuning_from_query
from asyncgrpo.transport.s3 import S3Transport

__all__ = ["DEFAULT_GATEWAY", "HFBucketTransport", "parse_hf_url"]

DEFAULT_GATEWAY = "https://s3.hf.co"
FORM = "hf://buckets/<namespace>/<bucket>[/prefix]"


def parse_hf_url(url: str) -> tuple[str, str, str, dict[str, str]]:
    """Split an ``hf://buckets/...`` URL into namespace, bucket, prefix and query options."""
    parts = urlsplit(url)
    if parts.scheme != "hf" or parts.fragment:
        raise ConfigError(f"malformed Hugging Face bucket URL {redact_url(url)!r}; expected {FORM}")
    segments = [s for s in (parts.netloc + parts.path).split("/") if s]
    if len(segments) < 3 or segments[0] != "buckets":
        raise ConfigError(
            f"malformed Hugging Face bucket URL {redact_url(url)!r}; expected {FORM} "
            "(model, dataset and Space repos are not buckets)"
        )
    query: dict[str, Any] = dict(parse_qsl(parts.query))
    unknown = set(query) - {"endpoint"} - set(TUNING_OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {sorted(unknown)} in {redact_url(url)!r}; accepted: endpoint, "
            f"{', '.join(TUNING_OPTIONS)}"
        )
    query.update(tuning_from_query(query, url))
    return segments[1], segments[2], "/".join(segments[3:]), query


class HFBucketTransport(S3Transport):
    """A Hugging Face Storage Bucket (or a prefix of one) as a transport."""

    def __init__(
        self,
        namespace: str,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        **options: Any,
    ) -> None:
        gateway = (endpoint or os.environ.get("HF_S3_ENDPOINT") or DEFAULT_GATEWAY).rstrip("/")
        super().__init__(
            bucket,
            prefix,
            endpoint=f"{gateway}/{namespace}",
            region="us-east-1",
            access_key_id=access_key_id
            or os.environ.get("HF_S3_ACCESS_KEY_ID")
            or os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_access_key=secret_access_key
            or os.environ.get("HF_S3_SECRET_ACCESS_KEY")
            or os.environ.get("AWS_SECRET_ACCESS_KEY"),
            url_scheme="hf",
            **options,
        )
        self.namespace = namespace
        self.url = f"hf://buckets/{namespace}/{bucket}" + (f"/{self.prefix}" if self.prefix else "")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> HFBucketTransport:
        namespace, bucket, prefix, query = parse_hf_url(url)
        return cls(namespace, bucket, prefix, **{**query, **options})
