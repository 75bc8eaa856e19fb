"""Server-flag checks against /server_info documents shaped like vLLM 0.32's."""

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.vllm_client import adapter_not_there_yet, check_adapter_fetching, check_lora_capacity


def info(lora: dict | None, block_size: int = 128) -> dict:
    return {"vllm_config": {"lora_config": lora, "cache_config": {"block_size": block_size}}}


def test_accepts_enough_slots_and_returns_block_size() -> None:
    assert (
        check_lora_capacity(
            info({"max_lora_rank": 8, "max_loras": 4}), lora_rank=8, max_staleness=2
        )
        == 128
    )


@pytest.mark.parametrize(
    ("lora", "flag"),
    [
        (None, "--enable-lora"),
        ({"max_lora_rank": 8, "max_loras": 6}, "--max-lora-rank"),
        ({"max_lora_rank": 16, "max_loras": 3}, "--max-loras"),
    ],
)
def test_refuses_naming_the_flag(lora: dict | None, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        check_lora_capacity(info(lora), lora_rank=16, max_staleness=2)


def plugin(url: str, *roots: str, ok: bool = True) -> dict:
    info = {"plugin": "asyncgrpo", "ok": ok, "error": None if ok else "vLLM 9 lacks it"}
    return {"url": url, "status": 200, "info": {**info, "transports": list(roots)}}


def test_adapter_fetching_check_accepts_replicas_that_allow_the_transport() -> None:
    check_adapter_fetching(
        [plugin("http://a", "s3://b/runs"), plugin("http://b", "s3://b/runs/r1", "/data")],
        "s3://b/runs/r1",
    )


def test_adapter_fetching_check_leaves_out_a_replica_that_could_not_be_reached() -> None:
    """A replica that left the fleet is not taken for one without the plugin."""
    gone = {"url": "http://b", "status": 0, "body": "ConnectionRefusedError: ..."}
    check_adapter_fetching([plugin("http://a", "s3://b/runs"), gone], "s3://b/runs/r1")


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ([plugin("http://a", "s3://b/runs"), {"url": "http://b", "status": 404, "body": "{}"}],
         "http://b has no asyncgrpo adapter plugin.*VLLM_PLUGINS=asyncgrpo"),
        ([plugin("http://a", "s3://b/runs-other")],
         r"http://a may not fetch adapters from s3://b/runs/r1.*--transport s3://b/runs/r1"),
        ([plugin("http://a")], "allows no transport"),
        ([plugin("http://a", "s3://b/runs", ok=False)], "vLLM 9 lacks it"),
        ([], "no replica"),
        ([{"url": "http://a", "status": 0, "body": "ConnectionRefusedError"}], "no replica"),
    ],
)  # fmt: skip
def test_adapter_fetching_check_names_the_replica_and_the_fix(
    replicas: list[dict], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_adapter_fetching(replicas, "s3://b/runs/r1")


@pytest.mark.parametrize(
    ("status", "body", "retry"),
    [
        (404, "Loading lora x failed: No adapter found for /p", True),
        (409, '{"error": {"type": "AdapterNotPublished"}}', True),
        (404, '{"detail": "Not Found"}', False),  # no such route: the plugin is missing
        (422, '{"error": {"type": "AdapterIntegrityError"}}', False),
        (403, "No adapter found", False),
    ],
)
def test_only_a_version_that_has_not_arrived_is_worth_retrying(
    status: int, body: str, retry: bool
) -> None:
    assert adapter_not_there_yet(status, body) is retry
    assert adapter_not_there_yet(status, body.encode()) is retry
