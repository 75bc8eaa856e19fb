"""Routing policies as plug-ins: the registry, and a new policy added as docs/proxy.md shows."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from asyncgrpo.config import proxy as proxy_config
from asyncgrpo.config.proxy import ROUTING_POLICIES, ProxyConfig
from asyncgrpo.proxy.policies.base import RoutingPolicy
from asyncgrpo.proxy.router import Router, make_policy, request_hashes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "proxy.md"


def test_every_registered_policy_is_a_policy_of_that_name() -> None:
    for name in ROUTING_POLICIES:
        policy = make_policy(name)
        assert isinstance(policy, RoutingPolicy)
        assert policy.name == name
        assert Router(policy=name).stats()["policy"] == name


def test_the_config_takes_exactly_the_registered_names() -> None:
    for name in ROUTING_POLICIES:
        assert ProxyConfig(routing=name).routing == name  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("proxy.routing='random'")):
        ProxyConfig(routing="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")


def _docs_example() -> str:
    """The python block of docs/proxy.md's "Routing policies" section."""
    section = DOCS.read_text().split("### Routing policies", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "docs/proxy.md shows no policy under 'Routing policies'"
    return match.group(1)


def test_a_new_policy_is_one_module_and_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy docs/proxy.md shows, as a module of its own and one registry entry, routes
    every request to the least-loaded replica, prompt and session ignored."""
    module = types.ModuleType("least_loaded_policy")
    exec(compile(_docs_example(), str(DOCS), "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(
        proxy_config.ROUTING_POLICIES, "least_loaded", f"{module.__name__}:LeastLoaded"
    )
    router = Router(policy="least_loaded")
    for name in ("r0", "r1", "r2"):
        router.add_replica(name)
    prompt = request_hashes({"model": "m", "prompt": list(range(64))}, 4)
    first = [router.route(prompt, session=7) for _ in range(3)]
    assert sorted(d.replica for d in first) == ["r0", "r1", "r2"]  # one each: least-loaded
    router.finish(first[1], ok=True)
    again = router.route(prompt, session=7)
    assert again.replica == first[1].replica  # the only one with a free slot
    assert router.tracked_sessions == 0 and router.tracked_blocks == 0
    assert router.decisions["unmatched"] == 4
    assert router.stats()["policy"] == "least_loaded"
