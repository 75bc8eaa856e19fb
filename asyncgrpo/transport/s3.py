"""S3 and S3-compatible stores (AWS, R2, MinIO, Hugging Face's gateway) via obstore.

Create-only writes are S3's conditional ``If-None-Match: *`` PUT, so ``mode="create"`` is a real
exclusive create rather than check-then-write. Reads, writes, retries and error mapping are the
shared :class:`~.objectstore.ObjectStoreTransport`; this module only sets up the store.

Configuration, first match wins: keyword options, then the URL query (``?endpoint=&region=``,
and the retry and time-out options of :data:`~.objectstore.TUNING_OPTIONS`: ``?timeout_s=10``),
then the usual environment variables obstore reads (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ...). Plain ``http://``
endpoints are allowed automatically (loopback test servers, MinIO).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from asyncgrpo.config.redaction import redact_url
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport.base import check_key
from asyncgrpo.transport.objectstore import TUNING_OPTIONS, ObjectStoreTransport, tuning_from_query

__all__ = ["S3Transport"]

_URL_OPTIONS = {"endpoint", "region"}


class S3Transport(ObjectStoreTransport):
    """Objects under ``s3://bucket/prefix``; keys are relative to the prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        url_scheme: str = "s3",
        **tuning: Any,
    ) -> None:
        """``tuning``: retry, timeout and chunk options of :class:`ObjectStoreTransport`."""
        from obstore.store import S3Store

        if not bucket:
            raise ConfigError("S3 transport needs a bucket: s3://bucket[/prefix]")
        self.bucket = bucket
        self.prefix = check_key(prefix, allow_empty=True)
        super().__init__(
            f"{url_scheme}://{bucket}" + (f"/{self.prefix}" if self.prefix else ""), **tuning
        )
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = False
        if region:
            config["region"] = region
        if access_key_id:
            config["access_key_id"] = access_key_id
        if secret_access_key:
            config["secret_access_key"] = secret_access_key
        if session_token:
            config["session_token"] = session_token
        effective_endpoint = (
            endpoint
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or os.environ.get("AWS_ENDPOINT")
            or ""
        )
        self._open(
            S3Store,
            bucket,
            prefix=self.prefix or None,
            allow_http=effective_endpoint.startswith("http://"),
            **config,
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Transport:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.fragment:
            raise ConfigError(
                f"malformed S3 URL {redact_url(url)!r}; expected s3://bucket[/prefix]"
            )
        query = dict(parse_qsl(parts.query, keep_blank_values=False))
        unknown = set(query) - _URL_OPTIONS - set(TUNING_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown S3 URL option(s) {sorted(unknown)} in {redact_url(url)!r}; "
                f"accepted: {sorted(_URL_OPTIONS | set(TUNING_OPTIONS))}"
            )
        query = {**query, **tuning_from_query(query, url)}
        return cls(parts.netloc, parts.path.strip("/"), **{**query, **options})
