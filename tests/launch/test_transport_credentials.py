"""Every launch backend accepts every object store the transports accept: per scheme, the
secrets a job on another machine gets (names in the specs, values never shown) and the names a
launch without them asks for. No request is sent: HF Jobs and SkyPilot specs are built offline
(SkyPilot's own task validation runs in ``test_skypilot.py``), the HF Jobs dry run against an
address nothing listens at."""

from __future__ import annotations

import json
from pathlib import Path

import gcs_keys
import pytest
from huggingface_hub import HfApi

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.hf_jobs import HfJobsBackend
from asyncgrpo.launch.launcher import dry_run
from asyncgrpo.launch.ray_jobs import RayBackend
from asyncgrpo.launch.skypilot import SkyPilotBackend
from asyncgrpo.transport.credentials import GCS_KEY_ENV
from asyncgrpo.transport.registry import job_credentials

TOKEN = "hf_fakeTOKENcredentials0123"
ACCOUNT_KEY = "ZmFrZS1henVyZS1hY2NvdW50LWtleQ=="
SAS = "sv=2024-01-01&sr=c&sp=rwdl&sig=fakeSASsignature42"
CONN = (
    f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={ACCOUNT_KEY};"
    "EndpointSuffix=core.windows.net"
)


@pytest.fixture
def private_key() -> str:
    return gcs_keys.private_key()


def key_file(path: Path, private_key: str, kind: str = "service_account") -> Path:
    return gcs_keys.key_file(path, kind)


def config(tmp_path: Path, url: str) -> TrainingConfig:
    data = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "run_name": "cred-run",
        "output_dir": str(tmp_path / "runs"),
        "transport_url": url,
        "dataset": {"prompts": ["p"]},
        "launch": {"replicas": 1},
    }
    return TrainingConfig.from_dict(data)


def backends(tmp_path: Path, url: str, environ: dict[str, str]) -> list:
    """The three backends whose jobs run on other machines, built offline."""
    cfg = config(tmp_path, url)
    where = tmp_path / "launch"
    api = HfApi(endpoint="http://127.0.0.1:9", token=TOKEN)
    return [
        HfJobsBackend(cfg, where, api=api, token=TOKEN, environ=environ),
        SkyPilotBackend(cfg, where, environ=environ, sdk=object()),
        RayBackend(cfg, where, environ=environ, sdk=object()),
    ]


def gs_cases(tmp_path: Path, private_key: str) -> list[tuple[str, dict[str, str]]]:
    adc_home = tmp_path / "home"
    key_file(adc_home / ".config" / "gcloud" / "application_default_credentials.json", private_key)
    named = key_file(tmp_path / "sa.json", private_key)
    return [
        ("GOOGLE_APPLICATION_CREDENTIALS", {"GOOGLE_APPLICATION_CREDENTIALS": str(named)}),
        ("application default credentials", {"HOME": str(adc_home)}),
        ("GOOGLE_SERVICE_ACCOUNT_KEY", {GCS_KEY_ENV: named.read_text()}),
    ]


def test_gs_jobs_get_the_service_account_key_as_a_secret(tmp_path: Path, private_key: str) -> None:
    for what, environ in gs_cases(tmp_path, private_key):
        for be in backends(tmp_path, "gs://bucket/run", environ):
            assert be.missing == [], (be.name, what)
            replica, trainer = be.replica_spec(0), be.trainer_spec(["http://r:8000"])
            for spec in (replica, trainer):
                assert json.loads(spec.secrets[GCS_KEY_ENV])["type"] == "service_account"
                shown = spec.describe() + repr(spec) + " ".join(spec.command)
                assert private_key.splitlines()[1] not in shown + json.dumps(dict(spec.env))
                assert GCS_KEY_ENV in spec.describe()


@pytest.mark.parametrize(
    ("url", "environ", "secret_names", "plain"),
    [
        (
            "az://c/run",
            {"AZURE_STORAGE_CONNECTION_STRING": CONN},
            {"AZURE_STORAGE_CONNECTION_STRING"},
            {},
        ),
        (
            "az://c/run",
            {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY},
            {"AZURE_STORAGE_ACCOUNT_KEY"},
            {"AZURE_STORAGE_ACCOUNT_NAME": "acct"},
        ),
        (
            "abfss://c@acct.dfs.core.windows.net/run",
            {"AZURE_STORAGE_SAS_TOKEN": SAS},
            {"AZURE_STORAGE_SAS_TOKEN"},
            {},
        ),
        (f"https://acct.blob.core.windows.net/c/run?{SAS}", {}, set(), {}),
    ],
    ids=["connection-string", "account-and-key", "sas-variable", "sas-in-url"],
)
def test_az_jobs_get_the_credential_they_open_the_container_with(
    tmp_path: Path, url: str, environ: dict, secret_names: set, plain: dict
) -> None:
    for be in backends(tmp_path, url, environ):
        assert be.missing == [], be.name
        replica, trainer = be.replica_spec(0), be.trainer_spec(["http://r:8000"])
        for spec in (replica, trainer):
            assert secret_names <= set(spec.secrets), (be.name, spec.role)
            assert plain.items() <= dict(spec.env).items()
            for value in (ACCOUNT_KEY, "fakeSASsignature42"):
                assert value not in spec.describe() + " ".join(spec.command)
        if "?" in url:  # the URL carries the SAS: it travels as a secret, not in a command
            assert "ASYNCGRPO_SERVE_TRANSPORTS" in replica.secrets
            assert "ASYNCGRPO_TRANSPORT_URL" in trainer.secrets


@pytest.mark.parametrize(
    ("url", "environ", "needle"),
    [
        ("gs://bucket/run", {}, "GOOGLE_APPLICATION_CREDENTIALS"),
        ("az://c/run", {"AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY}, "AZURE_STORAGE_ACCOUNT_NAME"),
        (
            "az://c/run",
            {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_USE_AZURE_CLI": "true"},
            "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or AZURE_STORAGE_CONNECTION_STRING",
        ),
    ],
    ids=["gs-nothing", "az-no-account", "az-cli-login-stays-here"],
)
def test_a_launch_without_the_credential_names_it_before_any_job(
    tmp_path: Path, url: str, environ: dict, needle: str
) -> None:
    for be in backends(tmp_path, url, environ):
        assert any(needle in name for name in be.missing), be.name
        if be.name != "skypilot":  # SkyPilot's check validates its task with its own SDK
            with pytest.raises(ConfigError, match=needle.split(",")[0]):
                be.check_offline()


def test_a_gcloud_user_login_is_not_sent_to_jobs(tmp_path: Path, private_key: str) -> None:
    home = tmp_path / "home"
    key_file(
        home / ".config" / "gcloud" / "application_default_credentials.json",
        private_key,
        kind="authorized_user",
    )
    with pytest.raises(ConfigError, match="service-account key file"):
        job_credentials("gs://bucket/run", {"HOME": str(home)})
    with pytest.raises(ConfigError, match="cannot be read"):
        job_credentials("gs://b/r", {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "no.json")})


def test_s3_and_hf_keep_their_names_and_a_directory_is_refused() -> None:
    environ = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "eu-west-1"}
    got = job_credentials("s3://bucket/run", environ)
    assert got.secrets == {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    assert got.plain == {"AWS_REGION": "eu-west-1"} and got.missing == []
    # an HF bucket takes the AWS pair as a fallback, under the names the HF transport reads
    got = job_credentials("hf://buckets/ns/b/run", environ)
    assert got.secrets == {"HF_S3_ACCESS_KEY_ID": "a", "HF_S3_SECRET_ACCESS_KEY": "s"}
    got = job_credentials("hf://buckets/ns/b/run", {})
    assert got.missing == ["HF_S3_ACCESS_KEY_ID", "HF_S3_SECRET_ACCESS_KEY"]
    for local in ("/some/dir", "file:///some/dir"):
        with pytest.raises(ConfigError, match="share no disk"):
            job_credentials(local, environ)


def test_hf_jobs_dry_run_on_gs_carries_the_key_by_name_only(
    tmp_path: Path, private_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncgrpo launch --backend hf-jobs --dry-run`` with a gs:// transport: the launcher
    opens the store to check it (its own key file), every job gets the key by name."""
    named = key_file(tmp_path / "sa.json", private_key)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(named))
    environ = {"GOOGLE_APPLICATION_CREDENTIALS": str(named), "HF_TOKEN": TOKEN}
    api = HfApi(endpoint="http://127.0.0.1:9", token=TOKEN)
    text = dry_run(config(tmp_path, "gs://bucket/run"), "hf-jobs", api=api, environ=environ)
    assert text.count(f"{GCS_KEY_ENV}, HF_TOKEN") == 2  # replica and trainer
    assert private_key.splitlines()[1] not in text and TOKEN not in text
