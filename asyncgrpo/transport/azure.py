"""Azure Blob Storage via obstore: ``az://container/prefix`` and the forms users paste.

Accepted URLs (all name a container and an optional prefix inside it):

* ``az://<container>[/prefix]`` and ``abfs[s]://<container>[/prefix]``: the account comes from
  options, ``AZURE_STORAGE_CONNECTION_STRING`` or ``AZURE_STORAGE_ACCOUNT_NAME``;
* ``abfs[s]://<container>@<account>.dfs.core.windows.net[/prefix]``;
* ``https://<account>.blob.core.windows.net/<container>[/prefix][?<SAS token>]`` (also
  ``.dfs.``); a SAS token in the query is used as the credential and dropped from ``url``, so
  it never reaches a log line.

Credentials, first match wins: keyword options (``account_key``, ``sas_token``, ``token``,
``connection_string``), a SAS token in the URL, ``AZURE_STORAGE_CONNECTION_STRING``, then what
obstore reads itself: ``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN``,
``AZURE_STORAGE_TOKEN``, a service principal (``AZURE_CLIENT_ID``/``AZURE_CLIENT_SECRET``/
``AZURE_TENANT_ID``), workload identity (``AZURE_FEDERATED_TOKEN_FILE``), ``AZURE_USE_AZURE_CLI``
or, on an Azure VM, its managed identity. With none of them the transport refuses to open and
names the variables to set, instead of failing later on the first request.

Create-only writes are Azure's conditional ``If-None-Match: *`` Put Blob (409 if the blob
exists), so exactly one of several concurrent creators wins, as with S3.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from asyncgrpo.errors import ConfigError
from asyncgrpo.transport.base import check_key
from asyncgrpo.transport.objectstore import ObjectStoreTransport

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "AzureBlobTransport",
    "AzureLocation",
    "azure_store_config",
    "parse_azure_url",
    "parse_connection_string",
]

FORMS = (
    "az://<container>[/prefix], abfs[s]://<container>[@<account>.dfs.core.windows.net][/prefix], "
    "https://<account>.blob.core.windows.net/<container>[/prefix]"
)
SCHEMES = ("az", "abfs", "abfss")
_HOST_SUFFIXES = (".blob.core.windows.net", ".dfs.core.windows.net")
# The development account every Azure Storage emulator (Azurite) uses; public by design.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: The variables that hold a credential itself (a launched job gets them as secrets).
SECRET_ENV = (
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_MASTER_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_CLIENT_SECRET",
)
#: ... and those that point at one on this machine (a token file, an identity endpoint).
_CREDENTIAL_ENV = (
    *SECRET_ENV,
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_MSI_ENDPOINT",
    "AZURE_IDENTITY_ENDPOINT",
    "IDENTITY_ENDPOINT",
    "MSI_ENDPOINT",
)
_FLAG_ENV = ("AZURE_USE_AZURE_CLI", "AZURE_STORAGE_USE_EMULATOR", "AZURE_SKIP_SIGNATURE")
# Every Azure VM carries this DMI asset tag; its managed identity is then a credential.
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


@dataclass(frozen=True, slots=True)
class AzureLocation:
    """What a URL says: container, prefix, maybe the account and a SAS token."""

    container: str
    prefix: str
    account: str | None = None
    sas_token: str | None = None


def parse_azure_url(url: str) -> AzureLocation:
    """Split any accepted Azure URL; :class:`ConfigError` naming the forms otherwise."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    bad = ConfigError(f"malformed Azure Blob URL {_without_query(url)!r}; expected {FORMS}")
    if parts.fragment:
        raise bad
    account: str | None = None
    sas: str | None = None
    if scheme == "https":
        host = (parts.hostname or "").lower()
        suffix = next((s for s in _HOST_SUFFIXES if host.endswith(s)), None)
        if suffix is None or not host[: -len(suffix)]:
            raise bad
        account = host[: -len(suffix)]
        container, _, prefix = parts.path.strip("/").partition("/")
        if parts.query:
            query = dict(parse_qsl(parts.query))
            if "sig" not in query:
                raise ConfigError(
                    f"the query of {_without_query(url)!r} is not a SAS token (no 'sig='); "
                    "drop it or paste the container's SAS URL"
                )
            sas = parts.query
    elif scheme in SCHEMES:
        if parts.query:
            raise ConfigError(
                f"{_without_query(url)!r}: {scheme}:// URLs take no query; pass options as "
                "keywords or use the https://<account>.blob.core.windows.net form for a SAS URL"
            )
        netloc = parts.netloc
        if "@" in netloc:
            container, _, host = netloc.partition("@")
            host = host.lower()
            suffix = next((s for s in _HOST_SUFFIXES if host.endswith(s)), None)
            if suffix is None or not host[: -len(suffix)]:
                raise bad
            account = host[: -len(suffix)]
        else:
            container = netloc
        prefix = parts.path.strip("/")
    else:
        raise bad
    if not container:
        raise bad
    try:
        prefix = check_key(prefix, allow_empty=True)
    except ValueError as exc:
        raise ConfigError(f"Azure URL {_without_query(url)!r}: prefix {exc}") from exc
    return AzureLocation(container=container, prefix=prefix, account=account, sas_token=sas)


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=Value;...`` as Azure writes it, keys lower-cased; values may contain ``=``."""
    fields: dict[str, str] = {}
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(
                "AZURE_STORAGE_CONNECTION_STRING is malformed: expected 'Key=Value;...' as "
                "copied from the portal (Access keys -> Connection string)"
            )
        fields[key.strip().lower()] = value.strip()
    return fields


def _without_query(url: str) -> str:
    return url.split("?", 1)[0]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def on_azure_vm() -> bool:
    """True on an Azure VM (a managed identity may exist); read from DMI, no network."""
    try:
        tag = Path("/sys/class/dmi/id/chassis_asset_tag").read_text().strip()
    except OSError:
        return False
    return tag == _AZURE_ASSET_TAG


def azure_store_config(
    location: AzureLocation,
    options: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    on_azure: bool,
) -> dict[str, Any]:
    """The obstore ``AzureStore`` keywords for ``location``; pure, so every rule is unit-tested.

    Raises :class:`ConfigError` naming the variable to set when no account or credential is
    reachable. Credentials obstore reads from the environment itself are not copied here.
    """
    config: dict[str, Any] = {}
    conn_text = options.get("connection_string") or env.get("AZURE_STORAGE_CONNECTION_STRING")
    conn = parse_connection_string(conn_text) if conn_text else {}
    if _truthy(conn.get("usedevelopmentstorage")):
        conn = {
            "accountname": AZURITE_ACCOUNT,
            "accountkey": AZURITE_KEY,
            "blobendpoint": f"http://127.0.0.1:10000/{AZURITE_ACCOUNT}",
        }
    account = (
        options.get("account_name")
        or location.account
        or conn.get("accountname")
        or env.get("AZURE_STORAGE_ACCOUNT_NAME")
    )
    if not account:
        raise ConfigError(
            f"no Azure storage account for container {location.container!r}: set "
            "AZURE_STORAGE_ACCOUNT_NAME or AZURE_STORAGE_CONNECTION_STRING, or use "
            "https://<account>.blob.core.windows.net/<container>/..."
        )
    if location.account and conn.get("accountname") and conn["accountname"] != location.account:
        raise ConfigError(
            f"the URL names Azure account {location.account!r} but the connection string is "
            f"for {conn['accountname']!r}"
        )
    config["account_name"] = account
    endpoint = options.get("endpoint") or conn.get("blobendpoint")
    if not endpoint and conn.get("endpointsuffix") and conn.get("accountname"):
        protocol = conn.get("defaultendpointsprotocol", "https")
        endpoint = f"{protocol}://{account}.blob.{conn['endpointsuffix']}"
    if endpoint:
        config["endpoint"] = endpoint.rstrip("/")
    credential_given = False
    for option, key in (
        ("account_key", "account_key"),
        ("sas_token", "sas_key"),
        ("token", "token"),
    ):
        if options.get(option):
            config[key] = options[option]
            credential_given = True
    if not credential_given and location.sas_token:
        config["sas_key"] = location.sas_token
        credential_given = True
    if not credential_given and conn.get("accountkey"):
        config["account_key"] = conn["accountkey"]
        credential_given = True
    if not credential_given and conn.get("sharedaccesssignature"):
        config["sas_key"] = conn["sharedaccesssignature"]
        credential_given = True
    from_env = any(env.get(name) for name in _CREDENTIAL_ENV) or any(
        _truthy(env.get(name)) for name in _FLAG_ENV
    )
    if not (credential_given or from_env or on_azure or options.get("skip_signature")):
        raise ConfigError(
            f"no credentials for Azure storage account {account!r}: set "
            "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or "
            "AZURE_STORAGE_CONNECTION_STRING (or a service principal: AZURE_CLIENT_ID, "
            "AZURE_CLIENT_SECRET, AZURE_TENANT_ID; or AZURE_FEDERATED_TOKEN_FILE; or "
            "AZURE_USE_AZURE_CLI=true; or run on Azure with a managed identity)"
        )
    if options.get("skip_signature"):
        config["skip_signature"] = True
    return config


class AzureBlobTransport(ObjectStoreTransport):
    """Blobs under one container (and prefix) of an Azure storage account."""

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        account_name: str | None = None,
        account_key: str | None = None,
        sas_token: str | None = None,
        token: str | None = None,
        connection_string: str | None = None,
        endpoint: str | None = None,
        skip_signature: bool = False,
        url: str | None = None,
        _location: AzureLocation | None = None,
        **tuning: Any,
    ) -> None:
        """``tuning``: retry, timeout and chunk options of :class:`ObjectStoreTransport`."""
        from obstore.store import AzureStore

        location = _location or AzureLocation(container, check_key(prefix, allow_empty=True))
        self.container = location.container
        self.prefix = location.prefix
        config = azure_store_config(
            location,
            {
                "account_name": account_name,
                "account_key": account_key,
                "sas_token": sas_token,
                "token": token,
                "connection_string": connection_string,
                "endpoint": endpoint,
                "skip_signature": skip_signature,
            },
            os.environ,
            on_azure=on_azure_vm(),
        )
        self.account = config["account_name"]
        shown = url or f"az://{self.container}" + (f"/{self.prefix}" if self.prefix else "")
        super().__init__(_without_query(shown).rstrip("/"), **tuning)
        effective_endpoint = config.get("endpoint") or os.environ.get("AZURE_STORAGE_ENDPOINT", "")
        self._open(
            AzureStore,
            self.container,
            prefix=self.prefix or None,
            allow_http=effective_endpoint.startswith("http://"),
            **config,
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AzureBlobTransport:
        location = parse_azure_url(url)
        return cls(location.container, location.prefix, url=url, _location=location, **options)
