"""A malformed rollout batch is moved aside and counted, never a wall the
trainer hits on every resume; names are matched whole, in ASCII; a bad name in a fetch URI is
a clear refusal, not a server error."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.sample import Sample
from asyncgrpo.serve.adapter_fetch import AdapterFetcher, SourceForbidden
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.store.codec import encode_batch
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


def _sample(tag: str) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-0.5, -0.25],
        reward=1.0,
        advantage=0.5,
        version=2,
        group_id=tag,
    )


def _poisoned_batch() -> bytes:
    """A batch that decodes as bytes but whose sample has a string version (crashes staleness)."""
    good = encode_batch([_sample("p")])
    head_len = int.from_bytes(good[5:9], "little")
    header = json.loads(good[9 : 9 + head_len])
    header[0]["version"] = "2"
    head = json.dumps(header, separators=(",", ":")).encode()
    return good[:5] + len(head).to_bytes(4, "little") + head + good[9 + head_len :]


@pytest.mark.parametrize("junk", [b"not a batch at all", "poisoned"])
async def test_a_malformed_batch_is_quarantined_and_the_consumer_moves_on(
    tmp_path: Path, junk: bytes | str
) -> None:
    transport = LocalTransport(tmp_path / "store")
    producer = RolloutChannel(transport)
    await producer.append([_sample("a")])
    bad = _poisoned_batch() if junk == "poisoned" else junk
    await transport.put("rollouts/batches/000000000001.agrb", bad, mode="create")
    producer._next_write = None  # a fresh producer: it continues after what it lists
    await producer.append([_sample("c")])

    consumer = RolloutChannel(transport, poll_interval_s=0.01)
    first = await consumer.receive(timeout_s=5)
    second = await consumer.receive(timeout_s=5)
    assert (first.seq, second.seq) == (0, 2)
    assert [s.group_id for s in second.samples] == ["c"]
    assert consumer.quarantined == 1
    assert await transport.get("rollouts/quarantine/000000000001.agrb") == bad
    assert await transport.get("rollouts/batches/000000000001.agrb") == b""  # tombstone
    await consumer.commit()

    # A restart from an older cursor (a resume from an earlier checkpoint) passes it too.
    restarted = RolloutChannel(transport, poll_interval_s=0.01)
    await restarted.seek(1)
    with anyio.fail_after(5):
        assert (await restarted.receive()).seq == 2
    # and a producer still never reuses its number
    assert await producer.append([_sample("d")]) == 3


@pytest.mark.parametrize("bad", ["run\n", "run1\u0661", "\u0661run", "-run", "r" * 129, ""])
def test_names_are_matched_whole_and_in_ascii(bad: str) -> None:
    from asyncgrpo.store.adapters import check_adapter_name

    with pytest.raises(ConfigError):
        check_adapter_name(bad)
    with pytest.raises(ConfigError, match="run_name"):
        TrainingConfig(model="m", dataset={"prompts": ["p"]}, run_name=bad)  # type: ignore[arg-type]


def test_versions_and_steps_are_ascii_digits_only() -> None:
    from asyncgrpo.store.adapters import parse_version

    assert parse_version("v12") == 12
    for bad in ("v\u0661", "v1\n", "v", "v-1", "V1", "v" + "9" * 5000):
        assert parse_version(bad) is None, bad


async def test_storage_names_in_other_scripts_are_not_versions(tmp_path: Path) -> None:
    """A key named with another script's digits neither lists as a version nor crashes."""
    transport = LocalTransport(tmp_path / "store")
    store = AdapterStore(transport)
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"w")
    await store.publish("run", 1, src)
    await transport.put("adapters/run/v\u0661/manifest.json", b"{}")
    await transport.put("checkpoints/step-\u0661/manifest.json", b"{}")
    await transport.put("rollouts/batches/\u0661.agrb", b"")
    assert await store.versions("run") == [1]
    from asyncgrpo.store.checkpoints import CheckpointStore

    assert await CheckpointStore(transport).steps() == []
    assert await RolloutChannel(transport).append([_sample("x")]) == 0


@pytest.mark.parametrize("name", ["x" * 129, "-dash", "caf\u00e9", "a b"])
def test_a_bad_adapter_name_in_a_fetch_uri_is_refused_before_any_read(
    tmp_path: Path, name: str
) -> None:
    root = LocalTransport(tmp_path / "store").url
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    with pytest.raises(SourceForbidden, match="adapter name"):
        fetcher.resolve(f"{root}/adapters/{name}/v1")


def test_a_version_too_long_for_an_int_is_refused(tmp_path: Path) -> None:
    """int() refuses 4,300+ digits: that was an unhandled ValueError (a 500) in the plugin."""
    root = LocalTransport(tmp_path / "store").url
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    with pytest.raises(SourceForbidden, match="v<N>"):
        fetcher.resolve(f"{root}/adapters/run/v{'9' * 5000}")
