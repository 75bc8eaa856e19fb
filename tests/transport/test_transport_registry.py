"""open_transport: URL forms, bad input, runtime and entry-point registration; local specifics."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.transport import check_transport_url, open_transport, register_scheme
from asyncgrpo.transport.hf import HFBucketTransport
from asyncgrpo.transport.local import LocalTransport
from asyncgrpo.transport.registry import ACCEPTED_FORMS
from asyncgrpo.transport.s3 import S3Transport


def test_plain_path_and_file_url(tmp_path: Path) -> None:
    t = open_transport(tmp_path / "a")
    assert isinstance(t, LocalTransport) and t.root == tmp_path / "a"
    u = open_transport(f"file://{tmp_path}/b")
    assert isinstance(u, LocalTransport) and u.root == tmp_path / "b"
    assert u.url == (tmp_path / "b").as_uri()
    assert open_transport(str(tmp_path / "c")).root == tmp_path / "c"


def test_s3_url_with_query_options() -> None:
    t = open_transport(
        "s3://my-bucket/some/prefix?endpoint=http://127.0.0.1:9&region=eu-west-1",
        access_key_id="k",
        secret_access_key="s",
    )
    assert isinstance(t, S3Transport)
    assert (t.bucket, t.prefix, t.url) == ("my-bucket", "some/prefix", "s3://my-bucket/some/prefix")


def test_retry_and_time_out_options_in_the_url() -> None:
    """Every process of a split run gets the same URL: one place tunes all their clients."""
    url = "s3://b/p?endpoint=http://127.0.0.1:9&timeout_s=7.5&max_retries=9&connect_timeout_s=2"
    t = open_transport(url, access_key_id="k", secret_access_key="s")
    assert t._client_options["timeout"].total_seconds() == 7.5
    assert t._client_options["connect_timeout"].total_seconds() == 2
    assert t._retry_config["max_retries"] == 9 and t.url == "s3://b/p"
    hf = open_transport(
        "hf://buckets/a/b/p?retry_timeout_s=30", access_key_id="k", secret_access_key="s"
    )
    assert hf._retry_config["retry_timeout"].total_seconds() == 30
    for bad in ("timeout_s=0", "timeout_s=soon", "max_retries=-1", "max_retries=2.5"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            open_transport(f"s3://b/p?{bad}")


def test_hf_bucket_url() -> None:
    t = open_transport(
        "hf://buckets/alice/rl-run/adapters", access_key_id="k", secret_access_key="s"
    )
    assert isinstance(t, HFBucketTransport)
    assert (t.namespace, t.bucket, t.prefix) == ("alice", "rl-run", "adapters")
    assert t.url == "hf://buckets/alice/rl-run/adapters"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("gopher://bucket/x", "unknown transport scheme 'gopher'"),
        ("gs://", "malformed GCS URL"),
        ("az://", "malformed Azure Blob URL"),
        ("https://example.com/x", "must be Azure Blob account URLs"),
        ("s3://", "malformed S3 URL"),
        ("s3://bucket/p?colour=blue", "unknown S3 URL option"),
        ("hf://alice/model", "malformed Hugging Face bucket URL"),
        ("hf://buckets/alice", "malformed Hugging Face bucket URL"),
        ("file://otherhost/x", "names host"),
        ("", "non-empty"),
        ("weird:/x", "malformed transport URL"),
    ],
)
def test_bad_urls_name_the_accepted_forms(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_transport(url)
    assert needle in str(info.value)
    if "scheme" in needle or "malformed transport" in needle or "non-empty" in needle:
        for form in ("s3://bucket[/prefix]", "gs://bucket[/prefix]", "az://container[/prefix]"):
            assert form in str(info.value)
        assert "hf://buckets/<namespace>/<bucket>[/prefix]" in str(info.value)


def test_register_scheme_at_runtime(tmp_path: Path) -> None:
    seen = {}

    def factory(url: str, **options):
        seen["url"], seen["options"] = url, options
        return LocalTransport(tmp_path / "mem")

    register_scheme("memtest", factory)
    try:
        t = open_transport("memtest://anything", flavour=1)
        assert isinstance(t, LocalTransport)
        assert seen == {"url": "memtest://anything", "options": {"flavour": 1}}
        with pytest.raises(ConfigError, match="already registered"):
            register_scheme("memtest", factory)
        with pytest.raises(ConfigError, match="already registered"):
            register_scheme("s3", factory)
    finally:
        from asyncgrpo.transport import registry

        registry._registry.pop("memtest", None)


def test_third_party_scheme_via_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real installed-distribution entry point (dist-info on sys.path), no code change here."""
    site = tmp_path / "site"
    dist = site / "thirdparty_transport-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-transport\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text("[asyncgrpo.transports]\nzipstore = zipstore_mod:open\n")
    (site / "zipstore_mod.py").write_text(
        textwrap.dedent(
            """
            from asyncgrpo.transport.local import LocalTransport

            def open(url, **options):
                return LocalTransport(url.split("://", 1)[1], **options)
            """
        )
    )
    monkeypatch.syspath_prepend(str(site))
    try:
        t = open_transport(f"zipstore://{tmp_path}/zs")
        assert isinstance(t, LocalTransport) and t.root == tmp_path / "zs"
    finally:
        from asyncgrpo.transport import registry

        registry._registry.pop("zipstore", None)
        sys.modules.pop("zipstore_mod", None)


@pytest.mark.anyio
async def test_local_temp_files_hidden_and_root_confined(tmp_path: Path) -> None:
    t = LocalTransport(tmp_path / "root")
    (tmp_path / "root" / "d").mkdir()
    (tmp_path / "root" / "d" / ".~asyncgrpo.x.123").write_bytes(b"partial")
    (tmp_path / "outside").write_bytes(b"secret")
    await t.put("d/real", b"1")
    assert [i.key async for i in t.list()] == ["d/real"]
    with pytest.raises(ValueError):
        await t.get("../outside")
    await t.delete("d/real")
    assert not (tmp_path / "root" / "d" / "real").exists()


def test_local_root_must_exist_without_create(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        LocalTransport(tmp_path / "nope", create=False)


# -- check_transport_url: what train --dry-run, serve and launch check before starting -------


def test_check_refuses_an_unknown_scheme_naming_every_accepted_form() -> None:
    with pytest.raises(ConfigError) as info:
        check_transport_url("ftp://x")
    message = str(info.value)
    assert message.startswith("unknown transport scheme 'ftp' in 'ftp://x'")
    for form in ACCEPTED_FORMS:
        assert form in message, form


def test_check_creates_and_contacts_nothing(tmp_path: Path) -> None:
    check_transport_url(tmp_path / "not-yet")  # a path is made on first use, not here
    check_transport_url(f"file://{tmp_path}/neither")
    check_transport_url("s3://bucket/prefix?endpoint=http://127.0.0.1:9")  # nothing listens
    assert list(tmp_path.iterdir()) == []


def test_check_refuses_a_store_without_the_credential_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgrpo.transport import gcs

    for name in (
        "GOOGLE_APPLICATION_CREDENTIALS",
        "STORAGE_EMULATOR_HOST",
        "GOOGLE_BASE_URL",
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_CONNECTION_STRING",
        *gcs._CREDENTIAL_ENV,
        *gcs._ON_GCP_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud credentials file either
    monkeypatch.setattr(gcs, "on_google_cloud", lambda: False)  # this host's DMI may say GCE
    with pytest.raises(ConfigError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        check_transport_url("gs://bucket/run")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_NAME"):
        check_transport_url("az://container/run")
