"""Azure Blob transport: URL forms, connection strings and credential rules (pure), plus the
credential paths end to end against Azurite. The conformance and fault suites cover the rest."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qsl, quote

import pytest

from asyncgrpo.errors import ConfigError, TransportError
from asyncgrpo.transport import open_transport
from asyncgrpo.transport.azure import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    AzureBlobTransport,
    AzureLocation,
    azure_store_config,
    parse_azure_url,
    parse_connection_string,
)

SAS = "sv=2024-05-04&ss=b&srt=co&sp=rwdl&se=2030-01-01T00:00:00Z&sig=SECRETSIG%3D"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("az://runs", AzureLocation("runs", "")),
        ("az://runs/a/b/", AzureLocation("runs", "a/b")),
        ("abfs://runs/a", AzureLocation("runs", "a")),
        ("abfss://runs@acct.dfs.core.windows.net/a", AzureLocation("runs", "a", "acct")),
        ("https://acct.blob.core.windows.net/runs/a", AzureLocation("runs", "a", "acct")),
        ("https://ACCT.dfs.core.windows.net/runs", AzureLocation("runs", "", "acct")),
        (
            f"https://acct.blob.core.windows.net/runs/a?{SAS}",
            AzureLocation("runs", "a", "acct", SAS),
        ),
    ],
)
def test_accepted_url_forms(url: str, expected: AzureLocation) -> None:
    assert parse_azure_url(url) == expected


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("az://", "malformed Azure Blob URL"),
        ("https://example.com/runs", "malformed Azure Blob URL"),
        ("https://acct.blob.core.windows.net/", "malformed Azure Blob URL"),
        ("abfs://runs@acct.example.com/a", "malformed Azure Blob URL"),
        ("az://runs/a?sig=x", "take no query"),
        ("https://acct.blob.core.windows.net/runs?colour=blue", "not a SAS token"),
        ("az://runs/../up", "prefix"),
    ],
)
def test_bad_urls(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_azure_url(url)


def test_connection_string_values_keep_their_equals_signs() -> None:
    fields = parse_connection_string(
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5==;EndpointSuffix=core.windows.net"
    )
    assert fields["accountname"] == "acct" and fields["accountkey"] == "a2V5=="
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING is malformed"):
        parse_connection_string("just-a-key")


def test_missing_account_names_the_variables() -> None:
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_NAME") as info:
        azure_store_config(AzureLocation("runs", ""), {}, {}, on_azure=False)
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(info.value)


def test_missing_credentials_name_the_variables() -> None:
    env = {"AZURE_STORAGE_ACCOUNT_NAME": "acct"}
    with pytest.raises(ConfigError, match="no credentials for Azure storage account 'acct'") as e:
        azure_store_config(AzureLocation("runs", ""), {}, env, on_azure=False)
    for name in (
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_CONNECTION_STRING",
    ):
        assert name in str(e.value)
    # a managed identity on an Azure VM, or any credential variable, is enough
    assert azure_store_config(AzureLocation("runs", ""), {}, env, on_azure=True) == {
        "account_name": "acct"
    }
    env_key = {**env, "AZURE_STORAGE_ACCOUNT_KEY": "k"}
    assert azure_store_config(AzureLocation("runs", ""), {}, env_key, on_azure=False) == {
        "account_name": "acct"
    }  # obstore reads the key from the environment itself


def test_connection_string_gives_account_key_and_endpoint() -> None:
    conn = (
        "DefaultEndpointsProtocol=http;AccountName=dev;AccountKey=a2V5;"
        "BlobEndpoint=http://127.0.0.1:1/dev;"
    )
    config = azure_store_config(
        AzureLocation("runs", ""), {}, {"AZURE_STORAGE_CONNECTION_STRING": conn}, on_azure=False
    )
    assert config == {
        "account_name": "dev",
        "account_key": "a2V5",
        "endpoint": "http://127.0.0.1:1/dev",
    }
    dev = azure_store_config(
        AzureLocation("runs", ""),
        {"connection_string": "UseDevelopmentStorage=true"},
        {},
        on_azure=False,
    )
    assert dev["account_name"] == AZURITE_ACCOUNT and dev["account_key"] == AZURITE_KEY
    sovereign = azure_store_config(
        AzureLocation("runs", ""),
        {"connection_string": "AccountName=a;AccountKey=k;EndpointSuffix=core.chinacloudapi.cn"},
        {},
        on_azure=False,
    )
    assert sovereign["endpoint"] == "https://a.blob.core.chinacloudapi.cn"


def test_sas_in_url_is_the_credential_and_never_shown() -> None:
    url = f"https://acct.blob.core.windows.net/runs/p?{SAS}"
    config = azure_store_config(parse_azure_url(url), {}, {}, on_azure=False)
    assert config == {"account_name": "acct", "sas_key": SAS}
    t = open_transport(url)
    assert isinstance(t, AzureBlobTransport)
    assert t.url == "https://acct.blob.core.windows.net/runs/p"
    assert "SECRETSIG" not in repr(t)


def test_account_mismatch_is_refused() -> None:
    with pytest.raises(ConfigError, match="names Azure account 'one'"):
        azure_store_config(
            AzureLocation("runs", "", "one"),
            {"connection_string": "AccountName=two;AccountKey=k"},
            {},
            on_azure=False,
        )


def test_https_urls_are_only_azure() -> None:
    with pytest.raises(ConfigError, match="must be Azure Blob account URLs"):
        open_transport("https://example.com/bucket")


# ---- credential paths end to end (Azurite) -----------------------------------------------------
@pytest.mark.anyio
async def test_connection_string_from_environment_and_wrong_key(
    azurite: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    t = open_transport("az://asyncgrpo-test/env-check")
    await t.put("a", b"1")
    assert await t.get("a") == b"1"
    await t.delete("a")


@pytest.mark.anyio
async def test_sas_credential_works_and_never_reaches_an_error_message(azurite: str) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    endpoint = parse_connection_string(azurite)["blobendpoint"]
    expiry = datetime.now(UTC) + timedelta(hours=1)

    def transport(**perms: bool) -> AzureBlobTransport:
        sas = generate_container_sas(
            AZURITE_ACCOUNT,
            "asyncgrpo-test",
            account_key=AZURITE_KEY,
            permission=ContainerSasPermissions(**perms),
            expiry=expiry,
        )
        return AzureBlobTransport(
            "asyncgrpo-test",
            "sas-check",
            account_name=AZURITE_ACCOUNT,
            sas_token=sas,
            endpoint=endpoint,
            max_retries=0,
        )

    writer = transport(read=True, write=True, list=True, delete=True)
    await writer.put("a", b"1")
    assert [i.key async for i in writer.list("")] == ["a"]
    reader = transport(read=True, list=True)  # a write is refused (403) and quoted in the error
    with pytest.raises(TransportError) as info:
        await reader.put("b", b"2")
    message = str(info.value)
    assert "403" in message  # still says what went wrong
    sig = dict(parse_qsl(reader._store.config["sas_key"]))["sig"]
    assert sig not in message and quote(sig, safe="") not in message
    await writer.delete("a")
