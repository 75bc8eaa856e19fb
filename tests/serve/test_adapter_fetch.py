"""The replica-side fetcher without vLLM: allow-list, verified fetch, bounded cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.errors import IntegrityError, NotFound
from asyncgrpo.serve.adapter_fetch import (
    CACHE_DIR_ENV,
    TRANSPORTS_ENV,
    AdapterFetcher,
    SourceForbidden,
    adapter_uri,
    parse_transports,
)
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport import open_transport

pytestmark = pytest.mark.anyio


def _adapter_dir(tmp_path: Path, payload: bytes = b"weights") -> Path:
    d = tmp_path / "adapter"
    d.mkdir(exist_ok=True)
    (d / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
    (d / "adapter_model.safetensors").write_bytes(payload)
    return d


@pytest.fixture
async def published(tmp_path: Path) -> tuple[str, AdapterStore]:
    """A store under <tmp>/shared/run1 with versions 0 and 1 of ``run-ab``."""
    root = tmp_path / "shared"
    store = AdapterStore(open_transport(str(root / "run1")))
    await store.publish("run-ab", 0, _adapter_dir(tmp_path, b"v0"))
    await store.publish("run-ab", 1, _adapter_dir(tmp_path, b"v1"))
    return open_transport(str(root)).url, store


def test_uri_names_the_version_under_the_store() -> None:
    assert adapter_uri("s3://b/run1", "adapters", "run-ab", 3) == "s3://b/run1/adapters/run-ab/v3"
    assert parse_transports(" s3://a/x, /data ,,") == ("s3://a/x", "/data")
    assert parse_transports(None) == ()


async def test_fetches_a_verified_copy_from_an_allowed_root(
    published: tuple[str, AdapterStore], tmp_path: Path
) -> None:
    root, store = published
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    uri = adapter_uri(store.transport.url, store.prefix, "run-ab", 1)
    ref = fetcher.resolve(uri)
    assert (ref.name, ref.version, ref.store_prefix) == ("run-ab", 1, "run1/adapters")
    path = await fetcher.fetch(ref)
    assert (path / "adapter_model.safetensors").read_bytes() == b"v1"
    assert path.is_relative_to(tmp_path / "cache")
    assert fetcher.cached() == [path]


@pytest.mark.parametrize(
    "uri, why",
    [
        ("s3://other-bucket/run1/adapters/run-ab/v1", "not under"),
        ("{root}x/run1/adapters/run-ab/v1", "not under"),  # a sibling sharing the prefix
        ("{root}/run1/../../etc/adapters/run-ab/v1", "'..'"),
        ("{root}/run1/adapters/run-ab/v1?endpoint=http://evil", "no query"),
        ("{root}/run1/adapters/run-ab/latest", "v<N>"),
        ("{root}/v1", "v<N>"),
        ("", "non-empty"),
        (None, "non-empty"),
    ],
)
async def test_refuses_uris_outside_the_allow_list_before_reading_anything(
    published: tuple[str, AdapterStore], tmp_path: Path, uri: str | None, why: str
) -> None:
    root, _ = published
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    with pytest.raises(SourceForbidden, match=why.replace("(", r"\(").replace("?", r"\?")):
        fetcher.resolve(uri.format(root=root) if uri else uri)
    assert fetcher.cached() == []


async def test_without_roots_every_uri_is_refused_with_the_fix(tmp_path: Path) -> None:
    fetcher = AdapterFetcher([], tmp_path / "cache")
    with pytest.raises(SourceForbidden, match="--transport"):
        fetcher.resolve("s3://b/run1/adapters/run-ab/v1")


async def test_a_tampered_file_is_refused_naming_it_and_nothing_is_cached(
    published: tuple[str, AdapterStore], tmp_path: Path
) -> None:
    root, store = published
    victim = next((tmp_path / "shared" / "run1").rglob("v1/files-*/adapter_model.safetensors"))
    victim.write_bytes(b"evil")
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    ref = fetcher.resolve(adapter_uri(store.transport.url, store.prefix, "run-ab", 1))
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors"):
        await fetcher.fetch(ref)
    assert fetcher.cached() == []


async def test_an_unpublished_version_is_not_found(
    published: tuple[str, AdapterStore], tmp_path: Path
) -> None:
    root, store = published
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    with pytest.raises(NotFound, match="published versions: 0, 1"):
        await fetcher.fetch(
            fetcher.resolve(adapter_uri(store.transport.url, store.prefix, "run-ab", 7))
        )


async def test_prune_keeps_only_what_vllm_still_serves(
    published: tuple[str, AdapterStore], tmp_path: Path
) -> None:
    root, store = published
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    v0, v1 = [
        await fetcher.fetch(
            fetcher.resolve(adapter_uri(store.transport.url, store.prefix, "run-ab", v))
        )
        for v in (0, 1)
    ]
    with fetcher.loading(v0):  # a load in progress: another load's prune must not take it
        assert fetcher.prune([v1]) == []
    assert fetcher.prune([v1]) == [v0]
    assert fetcher.cached() == [v1]


def test_from_env_makes_an_empty_cache_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(TRANSPORTS_ENV, f"{tmp_path / 'a'},{tmp_path / 'b'}")
    first, second = AdapterFetcher.from_env(port=8001), AdapterFetcher.from_env(port=8001)
    assert first.cache_dir != second.cache_dir  # a restart never reuses a cache
    assert first.cache_dir.parent == tmp_path and first.cache_dir.name.startswith(
        "asyncgrpo-adapters-8001-"
    )
    assert list(first.cache_dir.iterdir()) == [] and first.cached() == []
    assert first.roots == sorted(
        [open_transport(str(tmp_path / "a")).url, open_transport(str(tmp_path / "b")).url]
    )
