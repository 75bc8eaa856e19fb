"""Google Cloud Storage via obstore: ``gs://bucket[/prefix]``.

Credentials, first match wins: keyword options (``service_account`` key file path,
``service_account_key`` JSON, ``application_credentials`` path, ``bearer_token``), then what
obstore reads itself: ``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_SERVICE_ACCOUNT_PATH`` /
``GOOGLE_SERVICE_ACCOUNT_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``, the application default
credentials file ``gcloud auth application-default login`` writes, and on Google Cloud (GCE,
GKE, Cloud Run) the metadata server. With none of them the transport refuses to open and names
``GOOGLE_APPLICATION_CREDENTIALS``, instead of failing later on the first request.

Emulators: ``base_url=`` or ``STORAGE_EMULATOR_HOST`` (the variable Google's own client
libraries use) points the transport at one; emulators ignore authentication, so without other
credentials it sends none.

Create-only writes are GCS's conditional ``x-goog-if-generation-match: 0`` PUT (412 if the
object exists), so exactly one of several concurrent creators wins, as with S3. obstore talks
the GCS XML API.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncgrpo.config.redaction import redact_url
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport.base import check_key
from asyncgrpo.transport.objectstore import ObjectStoreTransport

__all__ = ["GCSTransport", "gcs_store_config", "parse_gcs_url"]

FORM = "gs://<bucket>[/prefix]"
_CREDENTIAL_ENV = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
)
_ON_GCP_ENV = ("K_SERVICE", "CLOUD_RUN_JOB", "FUNCTION_TARGET", "GCE_METADATA_HOST")
# What an emulator gets instead of a credential: obstore sends an empty bearer token.
_NO_OAUTH_KEY = json.dumps(
    {"disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
)


def parse_gcs_url(url: str) -> tuple[str, str]:
    """Split ``gs://bucket/prefix`` into bucket and prefix; :class:`ConfigError` otherwise."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "gs" or not parts.netloc or parts.fragment or parts.query:
        raise ConfigError(
            f"malformed GCS URL {url.split('?', 1)[0]!r}; expected {FORM} (options go as keywords)"
        )
    try:
        prefix = check_key(parts.path.strip("/"), allow_empty=True)
    except ValueError as exc:
        raise ConfigError(f"GCS URL {redact_url(url)!r}: prefix {exc}") from exc
    return parts.netloc, prefix


def on_google_cloud() -> bool:
    """True on GCE/GKE (DMI product name), no network: the metadata server then has a token."""
    try:
        product = Path("/sys/class/dmi/id/product_name").read_text().strip()
    except OSError:
        return False
    return product.startswith("Google")


def _emulator_url(value: str) -> str:
    value = value.strip().rstrip("/")
    return value if "://" in value else f"http://{value}"


def gcs_store_config(
    options: Mapping[str, Any], env: Mapping[str, str], *, home: Path, on_gcp: bool
) -> dict[str, Any]:
    """The obstore ``GCSStore`` keywords; pure, so every rule is unit-tested.

    Raises :class:`ConfigError` naming ``GOOGLE_APPLICATION_CREDENTIALS`` when no credential is
    reachable, or when it names a file that does not exist.
    """
    config: dict[str, Any] = {}
    for key in ("service_account", "service_account_key", "application_credentials"):
        if options.get(key):
            config[key] = options[key]
    if options.get("bearer_token"):
        config["bearer_token"] = options["bearer_token"]
    base_url = options.get("base_url") or env.get("GOOGLE_BASE_URL")
    emulator = env.get("STORAGE_EMULATOR_HOST")
    if not base_url and emulator:
        base_url = _emulator_url(emulator)
    if base_url:
        config["base_url"] = base_url.rstrip("/")
    adc_path = options.get("application_credentials") or env.get("GOOGLE_APPLICATION_CREDENTIALS")
    if adc_path and not Path(adc_path).expanduser().is_file():
        source = (
            "application_credentials"
            if options.get("application_credentials")
            else "GOOGLE_APPLICATION_CREDENTIALS"
        )
        raise ConfigError(
            f"{source}={adc_path!r} does not exist; point it at a service-account key file or "
            "run `gcloud auth application-default login`"
        )
    well_known = home / ".config" / "gcloud" / "application_default_credentials.json"
    has_credentials = (
        bool(config.keys() - {"base_url"})
        or bool(adc_path)
        or any(env.get(name) for name in _CREDENTIAL_ENV)
        or well_known.is_file()
        or on_gcp
        or any(env.get(name) for name in _ON_GCP_ENV)
    )
    if not has_credentials:
        if emulator or options.get("base_url"):
            config["service_account_key"] = _NO_OAUTH_KEY
        else:
            raise ConfigError(
                "no Google Cloud credentials for gs://: set GOOGLE_APPLICATION_CREDENTIALS to a "
                "service-account key file, run `gcloud auth application-default login`, or run "
                "on Google Cloud (its metadata server provides them)"
            )
    return config


class GCSTransport(ObjectStoreTransport):
    """Objects under ``gs://bucket/prefix``; keys are relative to the prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        service_account: str | None = None,
        service_account_key: str | None = None,
        application_credentials: str | None = None,
        bearer_token: str | None = None,
        base_url: str | None = None,
        **tuning: Any,
    ) -> None:
        """``tuning``: retry, timeout and chunk options of :class:`ObjectStoreTransport`."""
        from obstore.store import GCSStore

        if not bucket:
            raise ConfigError(f"GCS transport needs a bucket: {FORM}")
        self.bucket = bucket
        self.prefix = check_key(prefix, allow_empty=True)
        super().__init__(f"gs://{bucket}" + (f"/{self.prefix}" if self.prefix else ""), **tuning)
        config = gcs_store_config(
            {
                "service_account": service_account,
                "service_account_key": service_account_key,
                "application_credentials": application_credentials,
                "bearer_token": bearer_token,
                "base_url": base_url,
            },
            os.environ,
            home=Path.home(),
            on_gcp=on_google_cloud(),
        )
        self._open(
            GCSStore,
            bucket,
            prefix=self.prefix or None,
            allow_http=str(config.get("base_url", "")).startswith("http://"),
            **config,
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> GCSTransport:
        bucket, prefix = parse_gcs_url(url)
        return cls(bucket, prefix, **options)
