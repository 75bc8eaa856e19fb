"""GCS transport: URL and credential rules (pure), and the read path against fake-gcs-server.

fake-gcs-server serves GCS's XML API for reads, listing and deletes, which is what obstore
speaks, so those run here through the real transport. It cannot take obstore's XML writes
(see ``conftest.GCS_WRITES_SKIP``), so objects are seeded through its JSON upload API.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from asyncgrpo.errors import ConfigError, IntegrityError, NotFound, TransportError
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport import open_transport
from asyncgrpo.transport.gcs import GCSTransport, gcs_store_config, parse_gcs_url
from asyncgrpo.transport.local import LocalTransport

NO_HOME = Path("/nonexistent-home")


# ---- URLs and credentials (no I/O) ------------------------------------------------------------
def test_parse_gcs_url() -> None:
    assert parse_gcs_url("gs://bkt") == ("bkt", "")
    assert parse_gcs_url("gs://bkt/a/b/") == ("bkt", "a/b")


@pytest.mark.parametrize(
    "url", ["gs://", "gs://bkt/a?x=1", "gs://bkt/a#f", "gs://bkt/../up", "s3://bkt/a"]
)
def test_bad_gcs_urls(url: str) -> None:
    with pytest.raises(ConfigError, match="GCS URL"):
        parse_gcs_url(url)


def test_no_credentials_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        gcs_store_config({}, {}, home=NO_HOME, on_gcp=False)


def test_credentials_file_must_exist(tmp_path: Path) -> None:
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json")}
    with pytest.raises(ConfigError, match=r"GOOGLE_APPLICATION_CREDENTIALS=.*does not exist"):
        gcs_store_config({}, env, home=NO_HOME, on_gcp=False)
    key = tmp_path / "key.json"
    key.write_text("{}")
    assert (
        gcs_store_config(
            {}, {"GOOGLE_APPLICATION_CREDENTIALS": str(key)}, home=NO_HOME, on_gcp=False
        )
        == {}
    )  # (obstore reads the variable itself)


@pytest.mark.parametrize(
    ("env", "on_gcp", "home_adc"),
    [
        ({"GOOGLE_SERVICE_ACCOUNT_KEY": "{...}"}, False, False),
        ({"GOOGLE_SERVICE_ACCOUNT": "/k.json"}, False, False),
        ({"K_SERVICE": "svc"}, False, False),  # Cloud Run: the metadata server has a token
        ({}, True, False),  # GCE / GKE
        ({}, False, True),  # `gcloud auth application-default login`
    ],
)
def test_every_usual_credential_source_is_accepted(
    env: dict[str, str], on_gcp: bool, home_adc: bool, tmp_path: Path
) -> None:
    if home_adc:
        adc = tmp_path / ".config" / "gcloud" / "application_default_credentials.json"
        adc.parent.mkdir(parents=True)
        adc.write_text("{}")
    assert gcs_store_config({}, env, home=tmp_path, on_gcp=on_gcp) == {}


def test_emulator_host_needs_no_credentials() -> None:
    config = gcs_store_config(
        {}, {"STORAGE_EMULATOR_HOST": "localhost:4443"}, home=NO_HOME, on_gcp=False
    )
    assert config["base_url"] == "http://localhost:4443"
    assert json.loads(config["service_account_key"])["disable_oauth"] is True


def test_open_transport_gs_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    t = open_transport("gs://bkt/runs/one")
    assert isinstance(t, GCSTransport)
    assert (t.bucket, t.prefix, t.url) == ("bkt", "runs/one", "gs://bkt/runs/one")


# ---- the read path against fake-gcs-server -----------------------------------------------------
pytestmark = pytest.mark.anyio


def reader(base_url: str, prefix: str) -> GCSTransport:
    fast = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "max_retries": 4}
    return GCSTransport("asyncgrpo-test", prefix, base_url=base_url, **fast)


async def test_reads_lists_and_deletes_through_the_xml_api(
    fake_gcs: str, gcs_seed, tmp_path: Path
) -> None:
    prefix = f"r-{time.monotonic_ns()}"
    for key in ["p/a/1", "p/a/2", "p/a/deep/3", "p/ab/4", "q/5"]:
        gcs_seed(f"{prefix}/{key}", key.encode())
    t = reader(fake_gcs, prefix)
    assert await t.get("p/a/deep/3") == b"p/a/deep/3"
    info = await t.head("p/ab/4")
    assert (info.key, info.size) == ("p/ab/4", 6) and info.mtime is not None
    assert sorted([i.key async for i in t.list("p/a")]) == ["p/a/1", "p/a/2", "p/a/deep/3"]
    assert len([i async for i in t.list("")]) == 5
    with pytest.raises(NotFound):
        await t.get("p/a/none")
    assert not await t.exists("p/a/none")
    assert await t.get_file("p/a/2", tmp_path / "dl" / "x") == 5
    assert (tmp_path / "dl" / "x").read_bytes() == b"p/a/2"
    await t.delete("p/a/1")
    await t.delete("p/a/1")  # missing is fine
    assert not await t.exists("p/a/1")


async def test_fetch_verifies_and_refuses_a_tampered_file(
    fake_gcs: str, gcs_seed, tmp_path: Path
) -> None:
    """A bundle published elsewhere is fetched from GCS, verified, and refused once tampered."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
    (src / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 40)
    staging = LocalTransport(tmp_path / "staging")
    await AdapterStore(staging).publish("run", 1, src)
    prefix = f"f-{time.monotonic_ns()}"
    files = {info.key: await staging.get(info.key) async for info in staging.list("")}
    for key, data in files.items():
        gcs_seed(f"{prefix}/{key}", data)
    store = AdapterStore(reader(fake_gcs, prefix))
    assert await store.latest("run") == 1
    path = await store.fetch("run", 1, tmp_path / "ok")
    assert (path / "adapter_model.safetensors").read_bytes() == bytes(range(256)) * 40
    victim = next(k for k in files if k.endswith(".safetensors"))
    gcs_seed(f"{prefix}/{victim}", b"\xff" + files[victim][1:])  # same size, other bytes
    with pytest.raises(IntegrityError, match="sha256"):
        await store.fetch("run", 1, tmp_path / "bad")
    assert not (tmp_path / "bad" / "run-v1").exists()


async def test_transient_503s_on_reads_are_retried(gcs_seed, proxy_of) -> None:
    prefix = f"x-{time.monotonic_ns()}"
    gcs_seed(f"{prefix}/k", b"payload")
    proxy = proxy_of("gcs-proxy")
    t = reader(proxy.url, prefix)
    proxy.fail_next(3, 503)
    assert await t.get("k") == b"payload"
    assert proxy.failed == 3 and proxy.requests == 4
    proxy.fail_next(2, 503)
    assert [i.key async for i in t.list("")] == ["k"]
    assert proxy.failed == 5


async def test_permanent_error_is_not_retried(proxy_of) -> None:
    proxy = proxy_of("gcs-proxy")
    t = reader(proxy.url, "anything")
    proxy.fail_next(100, 403)
    with pytest.raises(TransportError) as info:
        await t.get("k")
    assert not isinstance(info.value, NotFound)
    assert proxy.requests == 1


async def test_create_only_write_sends_the_generation_precondition(proxy_of) -> None:
    """On the wire, mode="create" is GCS's documented exclusive create; overwrite is not.

    The emulator refuses the XML write itself (conftest.GCS_WRITES_SKIP); what it cannot show,
    the request does: a PUT of the object carrying ``x-goog-if-generation-match: 0``.
    """
    proxy = proxy_of("gcs-proxy")
    t = reader(proxy.url, "pre")
    with pytest.raises(TransportError):
        await t.put("m/manifest.json", b"{}", mode="create")
    with pytest.raises(TransportError):
        await t.put("m/other", b"{}")
    (m1, path1, create), (m2, path2, overwrite) = proxy.seen
    assert (m1, m2) == ("PUT", "PUT")
    assert unquote(path1) == "/asyncgrpo-test/pre/m/manifest.json"  # the XML API's object URL
    assert unquote(path2) == "/asyncgrpo-test/pre/m/other"
    assert create.get("x-goog-if-generation-match") == "0"
    assert "x-goog-if-generation-match" not in overwrite
