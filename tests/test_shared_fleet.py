"""Several training runs on one fleet: one standalone proxy in front of the session's two real
float32 vLLM replicas (``--max-loras 4``), two tiny runs training through it at once, a third
that would not fit refused at its start.

What would break it: a run's rollout served by the other run's adapter, or by a version its
sync never loaded (served logprobs then differ from the trainer's by far more than 1e-3); a
run's load, unload or leftover clean-up touching the other's versions (its requests 404); a sync
that pauses every replica (the other run's generation stops: the proxy counts the /pause).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import aiohttp
import anyio
import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.run.training import run_training
from asyncgrpo.sample import Sample
from asyncgrpo.serve import Replica
from asyncgrpo.testing.verify import served_logprob_errors

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
TOLERANCE = 1e-3
STEPS = 8


def run_config(tmp_path: Path, model: Path, proxy_url: str, name: str, *overrides: str):
    """The demo recipe at max_staleness 0 (2 LoRA slots: 2 runs fill the replicas' 4), sent to
    the shared proxy only."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(model), output_dir=str(tmp_path), run_name=name)
    data["serve"] = {"replicas": 0}
    data["proxy"] = {"upstreams": [proxy_url]}
    fixed = [f"trainer.max_steps={STEPS}", "trainer.max_staleness=0"]
    return TrainingConfig.from_dict(data, [*fixed, *overrides])


async def test_two_runs_share_two_replicas_and_a_third_that_does_not_fit_is_refused(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    proxy_cfg = ProxyConfig(upstreams=tuple(r.url for r in vllm_replicas), port=0)
    batches: dict[str, list[Sample]] = {"a": [], "b": []}
    steps_at: dict[str, list[float]] = {"a": [], "b": []}
    results = {}
    async with serve_proxy(proxy_cfg) as url, aiohttp.ClientSession() as http:

        async def registered() -> dict:
            async with http.get(f"{url}/proxy/runs") as resp:
                return {n: r for n, r in (await resp.json())["runs"].items() if r["lora_slots"]}

        async def train(name: str, *overrides: str, after: str | None = None) -> None:
            if after is not None:  # transformers cannot load two models at once in a process
                while not list((tmp_path / after / "store").rglob("v0/manifest.json")):  # noqa: ASYNC110
                    await anyio.sleep(0.2)
            cfg = run_config(tmp_path, tiny_model, url, name, *overrides)

            def on_step(step: int, samples: list[Sample], version: int) -> None:
                batches[name].extend(samples)
                steps_at[name].append(time.monotonic())

            results[name] = await run_training(cfg, on_step=on_step)

        async def third() -> None:
            """Once both runs hold their slots (2 + 2 of 4), a third asks for 2 more."""
            while len(await registered()) < 2:  # noqa: ASYNC110 (the proxy's state)
                await anyio.sleep(0.2)
            cfg = run_config(tmp_path, tiny_model, url, "c")
            with pytest.raises(ConfigError) as refused:
                await run_training(cfg)
            message = str(refused.value)
            assert "--max-loras 4" in message and "needs 2 LoRA slots" in message, message
            assert "4 of them taken by the 2 other run(s)" in message, message
            assert not list((cfg.run_dir / "store").rglob("manifest.json"))  # no first sync

        async with anyio.create_task_group() as tg:
            tg.start_soon(train, "a", "seed=1", "trainer.learning_rate=3e-2")
            tg.start_soon(partial(train, "b", "seed=2", "trainer.learning_rate=1e-2", after="a"))
            tg.start_soon(third)
        assert await registered() == {}  # both gave their slots back
        async with http.get(f"{url}/proxy/stats") as resp:
            stats = await resp.json()
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()

    prefixes = {name: r.adapter_prefix for name, r in results.items()}
    assert {name: r.steps for name, r in results.items()} == {"a": STEPS, "b": STEPS}
    assert steps_at["b"][0] < steps_at["a"][-2], steps_at  # they trained at the same time
    assert stats["adapters"] == []  # every version each run loaded was unloaded
    runs = stats["runs"]
    assert runs[prefixes["a"]]["requests"] > 0 and runs[prefixes["b"]]["requests"] > 0
    assert 'endpoint="pause"' not in metrics and 'endpoint="load",outcome="ok"' in metrics

    async def errors(run: str, of: str) -> list[float]:
        """Per sample of run ``of``: served logprobs against run ``run``'s adapter at the
        sample's version."""
        result = results[run]
        samples = [s for s in batches[of] if run == of or s.version > 0]  # v0s are all B = 0
        return await anyio.to_thread.run_sync(
            served_logprob_errors,
            tiny_model,
            result.transport_url,
            result.adapter_prefix,
            samples,
            tmp_path / f"check-{run}",
        )

    for name in ("a", "b"):
        versions = {s.version for s in batches[name]}
        assert len(versions) >= 4, (name, versions)
        diffs = await errors(name, name)
        assert len(diffs) == len(batches[name]) == STEPS * 32
        assert max(diffs) < TOLERANCE, f"run {name}: {sum(d >= TOLERANCE for d in diffs)} differ"
    # The check tells the runs apart: a's samples against b's adapters differ by far more.
    cross = await errors("b", "a")
    assert sum(d > 10 * TOLERANCE for d in cross) > 0.9 * len(cross), sorted(cross)[:10]
