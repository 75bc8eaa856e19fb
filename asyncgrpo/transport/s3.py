"""S3 and S3-compatible stores (AWS, R2, MinIO, GCS interop, Hugging Face's gateway) via obstore.

obstore is natively async (Rust, no thread pool), streams large objects, and supports S3's
conditional ``If-None-Match: *`` writes, which is what makes ``mode="create"`` a real
exclusive create rather than check-then-write.

Configuration, first match wins: keyword options, then the URL query (``?endpoint=&region=``),
then the usual environment variables obstore reads (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ...). Plain ``http://``
endpoints are allowed automatically (loopback test servers, MinIO).

Retries: obstore retries 5xx answers, dropped connections and timeouts with exponential backoff
and jitter (``max_retries``, ``retry_timeout_s``, ``backoff_initial_s``, ``backoff_max_s``);
4xx answers (bad credentials, missing bucket) are permanent and surface at once as
:class:`~asyncgrpo.errors.TransportError`. One caveat of retrying a create: if the first attempt
reached the server but its answer was lost, the retry reports ``AlreadyExists`` for our own write.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound, TransportError
from asyncgrpo.transport.base import (
    ObjectInfo,
    PutMode,
    Transport,
    _write_file_atomic,
    check_key,
)

__all__ = ["S3Transport"]

log = logging.getLogger(__name__)

_URL_OPTIONS = {"endpoint", "region"}


@contextlib.contextmanager
def _translate(what: str) -> Iterator[None]:
    """Map obstore's exceptions onto ours, once, at the edge."""
    from obstore.exceptions import (
        AlreadyExistsError,
        BaseError,
        NotFoundError,
        PreconditionError,
    )

    try:
        yield
    except (NotFoundError, FileNotFoundError) as exc:
        raise NotFound(f"{what} does not exist") from exc
    except (AlreadyExistsError, PreconditionError, FileExistsError) as exc:
        raise AlreadyExists(f"{what} already exists") from exc
    except BaseError as exc:
        raise TransportError(f"{what}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


class S3Transport(Transport):
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
        max_retries: int = 6,
        retry_timeout_s: float = 60.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        multipart_chunk_bytes: int = 8 * 1024 * 1024,
        url_scheme: str = "s3",
    ) -> None:
        from obstore.store import S3Store

        if not bucket:
            raise ConfigError("S3 transport needs a bucket: s3://bucket[/prefix]")
        self.bucket = bucket
        self.prefix = check_key(prefix, allow_empty=True)
        self.url = f"{url_scheme}://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._chunk = multipart_chunk_bytes
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
        client_options: dict[str, Any] = {
            "timeout": timedelta(seconds=timeout_s),
            "connect_timeout": timedelta(seconds=connect_timeout_s),
        }
        if effective_endpoint.startswith("http://"):
            client_options["allow_http"] = True
        retry_config: dict[str, Any] = {
            "max_retries": max_retries,
            "retry_timeout": timedelta(seconds=retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=backoff_initial_s),
                "max_backoff": timedelta(seconds=backoff_max_s),
                "base": 2,
            },
        }
        try:
            self._store = S3Store(
                bucket,
                prefix=self.prefix or None,
                client_options=client_options,
                retry_config=retry_config,
                **config,
            )
        except Exception as exc:  # obstore raises its own config errors
            raise ConfigError(f"cannot open {self.url}: {_first_line(exc)}") from exc

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Transport:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.fragment:
            raise ConfigError(f"malformed S3 URL {url!r}; expected s3://bucket[/prefix]")
        query = dict(parse_qsl(parts.query, keep_blank_values=False))
        unknown = set(query) - _URL_OPTIONS
        if unknown:
            raise ConfigError(
                f"unknown S3 URL option(s) {sorted(unknown)} in {url!r}; "
                f"accepted: {sorted(_URL_OPTIONS)}"
            )
        return cls(parts.netloc, parts.path.strip("/"), **{**query, **options})

    # ---- Transport ----------------------------------------------------------------------------
    def _what(self, key: str) -> str:
        return f"{self.url}/{key}"

    async def get(self, key: str) -> bytes:
        import obstore

        key = check_key(key)
        with _translate(self._what(key)):
            result = await obstore.get_async(self._store, key)
            return bytes(await result.bytes_async())

    async def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        import obstore

        key = check_key(key)
        with _translate(self._what(key)):
            await obstore.put_async(self._store, key, bytes(data), mode=mode)

    async def put_file(
        self, key: str, path: str | os.PathLike[str], *, mode: PutMode = "overwrite"
    ) -> None:
        import obstore

        key, path = check_key(key), Path(path)
        if not path.is_file():
            raise NotFound(f"local file {path} does not exist")
        with _translate(self._what(key)):
            # obstore streams a Path in multipart chunks; a create is a single conditional PUT.
            await obstore.put_async(self._store, key, path, mode=mode, chunk_size=self._chunk)

    async def get_file(self, key: str, path: str | os.PathLike[str]) -> int:
        import obstore

        key = check_key(key)
        with _translate(self._what(key)):
            result = await obstore.get_async(self._store, key)

            async def chunks() -> AsyncIterator[bytes]:
                with _translate(self._what(key)):
                    async for chunk in result.stream(min_chunk_size=self._chunk):
                        yield bytes(chunk)

            return await _write_file_atomic(Path(path), chunks())

    async def head(self, key: str) -> ObjectInfo:
        import obstore

        key = check_key(key)
        with _translate(self._what(key)):
            meta = await obstore.head_async(self._store, key)
        return ObjectInfo(key=meta["path"], size=meta["size"], mtime=_ts(meta))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:  # type: ignore[override]
        import obstore

        prefix = check_key(prefix, allow_empty=True)
        with _translate(self._what(prefix)):
            stream = obstore.list(self._store, prefix or None, chunk_size=1000)
            async for chunk in stream:
                for meta in chunk:
                    yield ObjectInfo(key=meta["path"], size=meta["size"], mtime=_ts(meta))

    async def delete(self, key: str) -> None:
        import obstore

        key = check_key(key)
        try:
            with _translate(self._what(key)):
                await obstore.delete_async(self._store, key)
        except NotFound:
            pass


def _ts(meta: Any) -> float | None:
    modified = meta.get("last_modified")
    return modified.timestamp() if modified is not None else None
