"""What a job on another machine needs to open a transport URL, per scheme.

A launched job (Hugging Face Jobs, SkyPilot, a Ray actor on another node) shares no disk and no
environment with the launcher: every credential it uses must travel with it. Each scheme's rule
here reads the launcher's environment (and the key file a variable names) and says which
variables the job gets as *secrets* (never printed), which as plain environment, and which the
launch still lacks. The rules name the same variables the transports themselves read
(:mod:`.s3`, :mod:`.hf`, :mod:`.gcs`, :mod:`.azure`), so a URL ``open_transport`` accepts on the
launcher opens on every backend. :func:`asyncgrpo.transport.registry.job_credentials` picks the
rule by scheme.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.errors import ConfigError

__all__ = [
    "CredentialRule",
    "JobCredentials",
    "azure_credentials",
    "gcs_credentials",
    "hf_credentials",
    "s3_credentials",
]


@dataclass(frozen=True)
class JobCredentials:
    """What a job gets to open one transport URL."""

    #: name -> value, handed to the job as secrets only
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    #: name -> value, plain environment (endpoints, regions, account names)
    plain: dict[str, str] = field(default_factory=dict)
    #: what the launcher's environment lacks, each a variable name (or a choice of them)
    missing: list[str] = field(default_factory=list)
    #: one phrase on how to get what is missing
    hint: str | None = None


#: ``rule(url, environ) -> JobCredentials``: ``environ`` is the launcher's environment.
CredentialRule = Callable[[str, Mapping[str, str]], JobCredentials]


def _present(names: tuple[str, ...], environ: Mapping[str, str]) -> dict[str, str]:
    return {name: environ[name] for name in names if environ.get(name)}


def s3_credentials(url: str, environ: Mapping[str, str]) -> JobCredentials:
    """``s3://``: the AWS key pair (and a session token), region and endpoint."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    secrets = _present((*names, "AWS_SESSION_TOKEN"), environ)
    plain = _present(
        ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"), environ
    )
    return JobCredentials(secrets, plain, [n for n in names if n not in secrets])


def hf_credentials(url: str, environ: Mapping[str, str]) -> JobCredentials:
    """``hf://buckets/``: the bucket's S3 key pair, under the names the HF transport reads
    (the AWS pair as a fallback), and its gateway."""
    secrets: dict[str, str] = {}
    missing: list[str] = []
    for name, fallback in (
        ("HF_S3_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
        ("HF_S3_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
    ):
        value = environ.get(name) or environ.get(fallback)
        if value:
            secrets[name] = value
        else:
            missing.append(name)
    return JobCredentials(
        secrets,
        _present(("HF_S3_ENDPOINT",), environ),
        missing,
        "HF_S3_*: the S3 key pair generated for your Hugging Face token",
    )


#: Variables that name a Google service-account key *file* on the launcher's host.
_GCS_KEY_FILES = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
)
#: The variable the job reads a key's JSON from (obstore reads it itself).
GCS_KEY_ENV = "GOOGLE_SERVICE_ACCOUNT_KEY"


def _adc_file(environ: Mapping[str, str]) -> Path | None:
    """The application default credentials file ``gcloud auth application-default login``
    writes, under ``$CLOUDSDK_CONFIG`` or ``$HOME/.config/gcloud``; None without either."""
    if environ.get("CLOUDSDK_CONFIG"):
        base = Path(environ["CLOUDSDK_CONFIG"])
    elif environ.get("HOME"):
        base = Path(environ["HOME"]) / ".config" / "gcloud"
    else:
        return None
    path = base / "application_default_credentials.json"
    return path if path.is_file() else None


def _service_account_key(path: Path, source: str) -> str:
    """The JSON of the service-account key file ``path``; :class:`ConfigError` for a file that
    is missing or holds another kind of credential."""
    try:
        text = path.expanduser().read_text()
        kind = json.loads(text).get("type")
    except OSError as exc:
        raise ConfigError(f"{source}={str(path)!r} cannot be read: {exc.strerror}") from None
    except (ValueError, AttributeError):
        raise ConfigError(f"{source}={str(path)!r} is not a JSON key file") from None
    if kind != "service_account":
        raise ConfigError(
            f"{source}={str(path)!r} holds {kind or 'unknown'!s} credentials, which are not "
            "sent to jobs on other machines (a user's login would travel with every job): "
            "point GOOGLE_APPLICATION_CREDENTIALS at a service-account key file"
        )
    return text


def gcs_credentials(url: str, environ: Mapping[str, str]) -> JobCredentials:
    """``gs://``: a service account's key, from ``GOOGLE_SERVICE_ACCOUNT_KEY`` or the file that
    ``GOOGLE_APPLICATION_CREDENTIALS`` (or the application default credentials) names, sent as
    the secret ``GOOGLE_SERVICE_ACCOUNT_KEY``: the file is on this host, not the job's. Or a
    bearer token. The metadata server of a launcher on Google Cloud is no credential for a job
    elsewhere."""
    secrets = _present((GCS_KEY_ENV, "GOOGLE_BEARER_TOKEN"), environ)
    if GCS_KEY_ENV not in secrets:
        named = next(((n, Path(environ[n])) for n in _GCS_KEY_FILES if environ.get(n)), None)
        adc = _adc_file(environ)
        if named is None and adc is not None:
            named = ("the application default credentials", adc)
        if named is not None:
            secrets[GCS_KEY_ENV] = _service_account_key(named[1], named[0])
    plain = _present(("STORAGE_EMULATOR_HOST", "GOOGLE_BASE_URL"), environ)
    missing = [] if secrets else ["GOOGLE_APPLICATION_CREDENTIALS"]
    return JobCredentials(
        secrets,
        plain,
        missing,
        "GOOGLE_APPLICATION_CREDENTIALS: a service-account key file; the jobs get its JSON as "
        f"{GCS_KEY_ENV}",
    )


#: Azure variables that only say where and who (plain environment).
_AZURE_PLAIN = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_STORAGE_TENANT_ID",
    "AZURE_AUTHORITY_HOST",
)


def azure_credentials(url: str, environ: Mapping[str, str]) -> JobCredentials:
    """``az://``, ``abfs[s]://``, ``https://<account>.blob.core.windows.net``: a connection
    string, an account key, a SAS token or a service principal's secret, and the account (from
    the URL, the connection string or ``AZURE_STORAGE_ACCOUNT_NAME``). A SAS token in the URL
    travels with the URL itself. The Azure CLI's login, workload identity and a managed identity
    belong to the launcher's machine, not the job's."""
    from asyncgrpo.transport.azure import SECRET_ENV, parse_azure_url, parse_connection_string

    location = parse_azure_url(url)
    secrets = _present(("AZURE_STORAGE_CONNECTION_STRING", *SECRET_ENV), environ)
    plain = _present(_AZURE_PLAIN, environ)
    conn = secrets.get("AZURE_STORAGE_CONNECTION_STRING")
    fields = parse_connection_string(conn) if conn else {}
    missing = []
    if not (
        location.account
        or fields.get("accountname")
        or plain.get("AZURE_STORAGE_ACCOUNT_NAME")
        or fields.get("usedevelopmentstorage")
    ):
        missing.append("AZURE_STORAGE_ACCOUNT_NAME")
    if not (secrets or location.sas_token):
        missing.append(
            "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or AZURE_STORAGE_CONNECTION_STRING"
        )
    return JobCredentials(
        secrets,
        plain,
        missing,
        "Azure: the storage account and a key, a SAS token or a connection string "
        "(or a service principal: AZURE_CLIENT_ID, AZURE_TENANT_ID, AZURE_CLIENT_SECRET)",
    )
