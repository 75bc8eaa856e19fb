"""The one obstore-backed transport: S3, Google Cloud Storage and Azure Blob differ only in setup.

obstore (Rust ``object_store`` bindings) is natively async, streams large objects in multipart
chunks, retries and speaks each cloud's conditional create: S3 ``If-None-Match: *``, GCS
``x-goog-if-generation-match: 0``, Azure ``If-None-Match: *``. So get/put/list/delete, error
mapping and retry tuning live here once; a subclass only turns its URL and credentials into an
obstore store and calls :meth:`ObjectStoreTransport._open`.

Retries: 5xx answers, dropped connections and timeouts are retried with exponential backoff and
jitter (``max_retries``, ``retry_timeout_s``, ``backoff_initial_s``, ``backoff_max_s``); 4xx
answers (bad credentials, missing bucket) are permanent and surface at once as
:class:`~asyncgrpo.errors.TransportError`. One caveat of retrying a create: if the first attempt
reached the server but its answer was lost, the retry reports ``AlreadyExists`` for our own write.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from asyncgrpo.config.redaction import redact_text, redact_url
from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound, TransportError
from asyncgrpo.transport.base import (
    ObjectInfo,
    PutMode,
    Transport,
    _write_file_atomic,
    check_key,
    too_large,
)

__all__ = ["TUNING_OPTIONS", "ObjectStoreTransport", "tuning_from_query"]

#: The retry and time-out options a URL query may set (``s3://b/p?timeout_s=10&max_retries=8``),
#: with their types: every process of a split run is given the same URL, so one place tunes
#: them all (a replica's plugin, a rollout process and the trainer alike).
TUNING_OPTIONS: dict[str, type] = {
    "max_retries": int,
    "retry_timeout_s": float,
    "backoff_initial_s": float,
    "backoff_max_s": float,
    "timeout_s": float,
    "connect_timeout_s": float,
}


def tuning_from_query(query: dict[str, str], url: str) -> dict[str, Any]:
    """The :data:`TUNING_OPTIONS` among ``query``, converted; :class:`ConfigError` naming the
    option for a value that is not a finite number > 0 (``max_retries``: an integer >= 0)."""
    out: dict[str, Any] = {}
    for key, kind in TUNING_OPTIONS.items():
        if key not in query:
            continue
        try:
            value = kind(query[key])
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < 0 or (kind is float and value == 0):
            what = "an integer >= 0" if kind is int else "a number > 0"
            raise ConfigError(f"{key}={query[key]!r} in {redact_url(url)!r}: write {what}")
        out[key] = value
    return out


def _first_line(exc: BaseException) -> str:
    """The first line of an obstore error, without the credentials it may quote (a SAS URL)."""
    text = str(exc).strip()
    return redact_text(text.splitlines()[0])[:300] if text else type(exc).__name__


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


def _ts(meta: Any) -> float | None:
    modified = meta.get("last_modified")
    return modified.timestamp() if modified is not None else None


class ObjectStoreTransport(Transport):
    """A bucket or container (or a prefix of one) in a cloud object store, through obstore."""

    _store: Any

    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 6,
        retry_timeout_s: float = 60.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        multipart_chunk_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        """``url`` is what logs and errors show, so it must never carry a credential."""
        self.url = url
        self._chunk = multipart_chunk_bytes
        self._client_options: dict[str, Any] = {
            "timeout": timedelta(seconds=timeout_s),
            "connect_timeout": timedelta(seconds=connect_timeout_s),
        }
        self._retry_config: dict[str, Any] = {
            "max_retries": max_retries,
            "retry_timeout": timedelta(seconds=retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=backoff_initial_s),
                "max_backoff": timedelta(seconds=backoff_max_s),
                "base": 2,
            },
        }

    def _open(
        self, factory: Callable[..., Any], *args: Any, allow_http: bool = False, **config: Any
    ) -> None:
        """Build the obstore store; its configuration errors become :class:`ConfigError`."""
        options = dict(self._client_options)
        if allow_http:
            options["allow_http"] = True
        try:
            self._store = factory(
                *args, client_options=options, retry_config=self._retry_config, **config
            )
        except Exception as exc:  # obstore raises its own config errors
            raise ConfigError(f"cannot open {self.url}: {_first_line(exc)}") from exc

    def _what(self, key: str) -> str:
        return f"{self.url}/{key}"

    # ---- Transport ----------------------------------------------------------------------------
    async def _open_get(self, key: str, max_bytes: int | None) -> Any:
        """A started GET, refused before its body is read if larger than ``max_bytes``."""
        import obstore

        result = await obstore.get_async(self._store, key)
        if max_bytes is not None and result.meta["size"] > max_bytes:
            raise too_large(self._what(key), max_bytes)
        return result

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        key = check_key(key)
        with _translate(self._what(key)):
            result = await self._open_get(key, max_bytes)
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

    async def get_file(
        self, key: str, path: str | os.PathLike[str], *, max_bytes: int | None = None
    ) -> int:
        key = check_key(key)
        with _translate(self._what(key)):
            result = await self._open_get(key, max_bytes)

            async def chunks() -> AsyncIterator[bytes]:
                seen = 0
                with _translate(self._what(key)):
                    async for chunk in result.stream(min_chunk_size=self._chunk):
                        seen += len(chunk)
                        if max_bytes is not None and seen > max_bytes:
                            raise too_large(self._what(key), max_bytes)
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
        except NotFound:  # Azure answers 404 for a missing blob; S3 and GCS do not
            pass
