"""The test-model cache: a build runs once per key, only a complete build is reused, and every
checkout of a user shares one cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.testing.model_cache import (
    CACHE_ENV,
    DONE,
    cache_key,
    cached_dir,
    default_cache_root,
    tree_digest,
)


def test_a_build_runs_once_per_key_and_an_incomplete_entry_is_rebuilt(tmp_path: Path) -> None:
    builds: list[Path] = []

    def build(out: Path) -> Path:
        builds.append(out)
        out.mkdir()
        (out / "weights").write_text(f"build {len(builds)}")
        return out

    key = cache_key(["model", "seed 0"])
    first = cached_dir(tmp_path, key, build)
    again = cached_dir(tmp_path, key, build)
    assert first == again == tmp_path / key and len(builds) == 1
    assert (first / "weights").read_text() == "build 1" and (first / DONE).is_file()
    assert cached_dir(tmp_path, cache_key(["model", "seed 1"]), build) != first
    assert len(builds) == 2
    (first / DONE).unlink()  # as a session killed mid-build leaves it
    assert (cached_dir(tmp_path, key, build) / "weights").read_text() == "build 3"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging


def test_the_digest_follows_names_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.pyc").write_bytes(b"\0")
    before = tree_digest(tmp_path, "*.py")
    (tmp_path / "b.pyc").write_bytes(b"\1")  # not matched: the same digest
    assert tree_digest(tmp_path, "*.py") == before != tree_digest(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    assert tree_digest(tmp_path, "*.py") != before


def test_the_tool_model_key_follows_its_training_data_not_the_rest_of_the_package(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgrpo.rollout.environment import ChatContinuation
    from asyncgrpo.testing.tool_model import tool_model_key

    key = tool_model_key(tiny_model)
    assert tool_model_key(tiny_model) == key != tool_model_key(tiny_model, seed=1)
    # A change to how a tool's result is rendered, in another module, changes what it learns.
    text = ChatContinuation.text
    monkeypatch.setattr(ChatContinuation, "text", lambda *a, **k: text(*a, **k) + " ")
    assert tool_model_key(tiny_model) != key


def test_the_cache_is_the_users_unless_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgrpo.testing.emulators import AZURITE_VERSION, azurite_binary

    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "asyncgrpo" / "test-models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "asyncgrpo" / "test-models"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert default_cache_root() == tmp_path / "mine"
    # the Azure emulator's npm install is found beside the models, not in the checkout
    emulators = tmp_path / "xdg" / "asyncgrpo" / "emulators"
    (emulators / "node_modules" / ".bin").mkdir(parents=True)
    (emulators / "node_modules" / ".bin" / "azurite-blob").touch()
    (emulators / f".azurite-{AZURITE_VERSION}").touch()
    monkeypatch.setenv("PATH", str(tmp_path / "no-npm"))  # an install would fail
    assert azurite_binary() == emulators / "node_modules" / ".bin" / "azurite-blob"
