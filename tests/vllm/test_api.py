"""vLLM's API as asyncgrpo reads it (asyncgrpo.vllm.api): the served-name pair against the names
every module built by hand before it, the load rules the proxy and the plugin share, and the
readers of vLLM's answers."""

import re
import time

import pytest

from asyncgrpo.vllm import api
from asyncgrpo.vllm.api import parse_served_name, served_name


def _old_names() -> list[tuple[str, str, int]]:
    """(name, prefix, version) as each module built served names before the pair existed, with
    its own expression: they must all parse back, and the pair must build the same name."""
    prefix, version = "math-1a2b3c4d", 12
    sync_adapter_name = f"{prefix}-v{version}"  # run/sync.py adapter_name
    name, v = "run-a1b2", 1
    store_adapter_name = f"{name}-v{v}"  # store/adapters.py AdapterVersion.adapter_name
    store_cache_dir = f"{name}-v{v}"  # store/adapters.py AdapterStore.fetch's directory
    uri = "s3://bucket/run1/adapters/run-1a2b/v3"  # vllm/client.py plugin_served_name
    parts = uri.rsplit("/", 2)
    client_plugin_name = f"{parts[1]}-v{int(re.fullmatch(r'v([0-9]+)', parts[-1])[1])}"  # type: ignore[index]
    padded = "s3://bucket/adapters/tiny-v2/v007".rsplit("/", 2)
    client_padded_name = f"{padded[1]}-v{int(padded[-1][1:])}"
    ref_name, ref_version = "tiny-9f8e", 0  # AdapterRef fields
    plugin_name = f"{ref_name}-v{ref_version}"  # serve/vllm_plugin.py load check
    fetch_cache_dir = f"{ref_name}-v{ref_version}"  # serve/adapter_fetch.py AdapterFetcher.fetch
    run_prefix, final_version = "gsm8k-00ff00ff", 250
    final = f"{run_prefix}-v{final_version}"  # run/job.py and cli/main.py "final adapter"
    return [
        (sync_adapter_name, prefix, version),
        (store_adapter_name, name, v),
        (store_cache_dir, name, v),
        (client_plugin_name, "run-1a2b", 3),
        (client_padded_name, "tiny-v2", 7),
        (plugin_name, ref_name, ref_version),
        (fetch_cache_dir, ref_name, ref_version),
        (final, run_prefix, final_version),
    ]


@pytest.mark.parametrize(("name", "prefix", "version"), _old_names())
def test_every_name_the_modules_built_parses_and_is_built_the_same(
    name: str, prefix: str, version: int
) -> None:
    assert parse_served_name(name) == (prefix, version)
    assert served_name(prefix, version) == name


def test_what_the_proxy_took_for_a_run_it_still_takes() -> None:
    """proxy/runs.py's run_of matched ``(.+)-v[0-9]+`` before; on the names it met they agree."""
    old = re.compile(r"(.+)-v[0-9]+")
    for name in ("tiny-1a2b3c4d-v12", "tiny-v2-v0", "a-v1-v2-v3", "x-v999999999999999999"):
        parsed = parse_served_name(name)
        assert parsed is not None and parsed[0] == old.fullmatch(name)[1], name  # type: ignore[index]


@pytest.mark.parametrize(
    "name",
    [
        "Qwen/Qwen2.5-1.5B",
        "x-v",
        "-v3",
        "x-v3a",
        "x_v3",
        "x-V3",
        "x-v-1",
        "x-v01",
        "x-v00",
        "x-v1 ",
        "x-v\u0661",
        "x-v" + "9" * 19,  # 19 digits: not a version
    ],
)
def test_a_name_that_is_no_served_version_parses_to_none(name: str) -> None:
    assert parse_served_name(name) is None


def test_a_five_thousand_digit_version_is_not_a_version_and_costs_nothing() -> None:
    """An unbounded int() raises on it (Python refuses over 4,300 digits)."""
    started = time.perf_counter()
    assert parse_served_name("run-1a2b-v" + "7" * 5000) is None
    assert api.uri_served_name("s3://b/adapters/run-1a2b/v" + "7" * 5000) is None
    assert time.perf_counter() - started < 0.05


def test_round_trip_over_the_range() -> None:
    for version in (0, 1, 9, 10, 12345, 10**17, 10**18 - 1):
        for prefix in ("a", "run-1a2b", "tiny-v2", "x.y_z-v"):
            assert parse_served_name(served_name(prefix, version)) == (prefix, version)


@pytest.mark.parametrize(
    ("prefix", "version"), [("", 1), ("a", -1), ("a", True), ("a", 10**18), ("a", 1.0)]
)
def test_served_name_refuses_what_would_not_parse_back(prefix: str, version: object) -> None:
    with pytest.raises(ValueError, match=r"served_name|adapter version"):
        served_name(prefix, version)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("uri", "name"),
    [
        ("s3://b/run1/adapters/run-1a2b/v3", "run-1a2b-v3"),
        ("file:///data/adapters/x/v0", "x-v0"),
        ("s3://b/adapters/x/v007", "x-v7"),  # the store reads v007 as version 7
        ("s3://b/adapters/x/v" + "9" * 18, "x-v" + "9" * 18),
        ("s3://b/adapters/x/v" + "9" * 19, None),
        ("s3://b/adapters/x/latest", None),
        ("v3", None),
        ("s3://b//v3", None),
    ],
)
def test_the_served_name_of_a_plugin_uri(uri: str, name: str | None) -> None:
    assert api.uri_served_name(uri) == name


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ({"lora_name": "x-v1", "lora_path": "/p"}, None),
        ({"lora_name": "x-v1", "load_inplace": False}, None),
        ({"lora_path": "/p"}, "lora_name must be a non-empty string"),
        ({"lora_name": ""}, "lora_name must be a non-empty string"),
        ({"lora_name": 3}, "lora_name must be a non-empty string"),
        ({"lora_name": "x-v1", "load_inplace": True}, "load_inplace is refused"),
        ({"lora_name": "x-v1", "load_inplace": 1}, "load_inplace is refused"),
    ],
)
def test_the_load_rule(body: dict, refusal: str | None) -> None:
    why = api.load_refusal(body)
    assert why is None if refusal is None else why is not None and why.startswith(refusal)


@pytest.mark.parametrize(
    ("name", "uri", "refusal"),
    [
        ("run-v3", "s3://b/adapters/run/v3", None),
        ("run-v2", "s3://b/adapters/run/v3", "'run-v3'"),
        ("other-v3", "s3://b/adapters/run/v3", "'run-v3'"),
        ("run-v3", "s3://b/run", "v<N>"),
        ("run-v3", None, "lora_uri must be a non-empty string"),
        ("run-v3", "", "lora_uri must be a non-empty string"),
    ],
)
def test_a_plugin_load_serves_a_version_under_its_own_name_only(
    name: str, uri: object, refusal: str | None
) -> None:
    why = api.uri_refusal(name, uri)
    assert why is None if refusal is None else why is not None and refusal in why


def test_the_uri_refusal_does_not_echo_the_uri() -> None:
    """A URI may carry credentials (``s3://key:secret@...``): the answer names the rule only."""
    why = api.uri_refusal("run-v3", "s3://AKIA:hunter2@b/run")
    assert why is not None and "hunter2" not in why


def test_unload_path_matches_the_load_path() -> None:
    assert api.unload_path(api.PLUGIN_LOAD_PATH) == api.PLUGIN_UNLOAD_PATH
    assert api.unload_path(api.LOAD_LORA_PATH) == api.UNLOAD_LORA_PATH


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
    assert api.adapter_not_there_yet(status, body) is retry
    assert api.adapter_not_there_yet(status, body.encode()) is retry


def test_already_loaded_reads_vllms_refusal() -> None:
    body = "The lora adapter 'x-v1' has already been loaded."
    assert api.already_loaded(400, body) and api.already_loaded(400, body.encode())
    assert not api.already_loaded(404, body) and not api.already_loaded(400, b"bad request")


@pytest.mark.parametrize(
    ("status", "body", "off"),
    [
        (404, '{"detail":"Not Found"}', True),
        (404, "No adapter found for /p", False),
        (400, "bad", False),
    ],
)
def test_a_404_without_vllms_words_means_the_lora_routes_are_off(
    status: int, body: str, off: bool
) -> None:
    assert api.lora_routes_off(status, body) is off


def test_the_plugin_is_missing_on_a_404_that_is_not_a_missing_version() -> None:
    assert api.plugin_missing(404, '{"detail":"Not Found"}')
    assert not api.plugin_missing(404, "AdapterNotPublished: s3://b/x/v1")
    assert not api.plugin_missing(409, "AdapterNotPublished")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"error": {"message": "run b-2 needs 2 LoRA slots", "code": 409}}',
            "run b-2 needs 2 LoRA slots",
        ),
        ('{"error": "plain"}', '{"error": "plain"}'),
        ("not json", "not json"),
        ("[1, 2]", "[1, 2]"),
        ("x" * 900, "x" * 500),
    ],
)
def test_error_message(text: str, message: str) -> None:
    assert api.error_message(text) == message


def test_model_ids() -> None:
    doc = b'{"object": "list", "data": [{"id": "Qwen/Qwen3-0.6B"}, {"id": "run-v1"}, {"x": 1}]}'
    assert api.model_ids(doc) == ["Qwen/Qwen3-0.6B", "run-v1"]
    for bad in (b"[]", b'{"data": 3}', b"nope"):
        with pytest.raises(ValueError):
            api.model_ids(bad)


def test_plugin_answers_of_a_replica_a_proxy_and_a_server_without_the_plugin() -> None:
    info = b'{"plugin": "asyncgrpo", "ok": true, "transports": ["s3://b"]}'
    assert api.plugin_answers("http://r:1", 200, info) == [
        {
            "url": "http://r:1",
            "status": 200,
            "info": {"plugin": "asyncgrpo", "ok": True, "transports": ["s3://b"]},
        }
    ]
    relayed = '{"replicas": [{"url": "http://r:1", "status": 404, "body": "{}"}]}'
    assert api.plugin_answers("http://p", 200, relayed) == [
        {"url": "http://r:1", "status": 404, "body": "{}"}
    ]
    assert api.plugin_answers("http://r:2", 404, b"x" * 999) == [
        {"url": "http://r:2", "status": 404, "body": "x" * 300}
    ]


def test_server_info_readers() -> None:
    doc = {
        "vllm_config": {
            "cache_config": {"block_size": 16},
            "lora_config": {"max_loras": 4},
            "scheduler_config": {"max_num_seqs": True},
        }
    }
    assert api.block_size_of(doc) == 16 and api.lora_slots_of(doc) == 4
    assert api.max_num_seqs_of(doc) is None  # a bool is not a count
    assert api.block_size_of({"vllm_config": "a string in some versions"}) is None
    assert api.lora_slots_of(None) is None


@pytest.mark.parametrize(
    ("body", "named"), [({"lora_name": "x-v1"}, True), ({"lora_name": ""}, False), ({}, False)]
)
def test_an_unload_names_the_adapter(body: dict, named: bool) -> None:
    assert (api.name_refusal(body) is None) is named
