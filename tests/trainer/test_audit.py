"""The served-policy audit: which samples it picks, how it compares, its verdict (plain logic);
the trainer's forward at a saved version; and the run's audit on a real tiny trainer."""

from __future__ import annotations

import dataclasses
import math

import anyio
import pytest
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import AuditConfig, LoraConfig, TrainerConfig
from asyncgrpo.errors import AuditError, ConfigError
from asyncgrpo.rollout.environment import Episode
from asyncgrpo.run.audit import ServedPolicyAudit
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.audit import AuditTally, RecentSamples, by_version, replica_key, spread

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def _sample(tag: str, replica: str | None, n: int = 3, **kw) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        completion_ids=list(range(10, 10 + n)),
        logprobs=kw.pop("logprobs", [-1.0] * n),
        reward=0.0,
        advantage=0.0,
        version=kw.pop("version", 0),
        group_id=tag,
        replica=replica,
        **kw,
    )


def test_replica_key_is_one_metric_segment() -> None:
    assert replica_key(A) == "127.0.0.1:8001"
    assert replica_key("https://host/v1/") == "host_v1"
    assert replica_key(None) == replica_key("") == "unnamed"


def test_spread_takes_round_robin_newest_first_from_a_moving_start() -> None:
    a = [_sample(f"a{i}", A) for i in range(3)]
    b = [_sample("b0", B)]
    c = [_sample(f"c{i}", "c") for i in range(2)]
    assert [s.group_id for s in spread([a, b, c], 4)] == ["a0", "b0", "c0", "a1"]
    assert [s.group_id for s in spread([a, b, c], 4, start=1)] == ["b0", "c0", "a0", "c1"]
    assert [s.group_id for s in spread([a, b, c], 10)] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert spread([], 3) == []


def test_recent_samples_bounded_per_replica_and_rotating() -> None:
    recent = RecentSamples(per_replica=2)
    recent.add([_sample(f"a{i}", A) for i in range(5)] + [_sample("b0", B), _sample("e", A, n=0)])
    assert [s.group_id for s in recent.take(3)] == ["a4", "b0", "a3"]  # newest first
    assert recent.take(3) == []  # taken: the next audit sees only what is trained after
    recent.add([_sample("a5", A), _sample("b1", B)])
    assert [s.group_id for s in recent.take(1)] == ["b1"]  # the start moved to the next replica


def test_by_version_splits_a_multi_turn_sample() -> None:
    multi = _sample(
        "m", A, n=4, version=2, versions=[2, 2, 3, 3], completion_mask=[True, False, True, True]
    )
    env_only_v4 = _sample("e", A, n=2, version=1, versions=[1, 4], completion_mask=[True, False])
    plan = by_version([multi, env_only_v4, _sample("s", B, version=2)])
    assert {v: [s.group_id for s in g] for v, g in plan.items()} == {
        1: ["e"],
        2: ["m", "s"],
        3: ["m"],
    }


def test_tally_metrics_per_replica_and_the_verdict_names_the_worst() -> None:
    tally = AuditTally()
    good = _sample("g", A, logprobs=[-1.0, -2.0, -3.0])
    tally.add(good, 0, [-1.0, -2.0005, -3.0])
    bad = _sample("b", B, version=3, logprobs=[-1.0, -2.0, -3.0])
    tally.add(bad, 3, [-1.2, -2.0, -3.05])
    multi = _sample(
        "m",
        B,
        n=3,
        version=3,
        versions=[3, 3, 4],
        completion_mask=[True, False, True],
        logprobs=[-1.0, 0.0, -1.0],
    )
    tally.add(multi, 4, [-9.0, -9.0, -1.0])  # only the v4 token counts at v4
    m = tally.metrics()
    assert m["audit/tokens"] == 7
    assert m["audit/max_abs_logprob_diff"] == pytest.approx(0.2)
    assert m["audit/mean_abs_logprob_diff"] == pytest.approx((0.0005 + 0.2 + 0.05) / 7)
    assert m["audit/replica/127.0.0.1:8001/max_abs_logprob_diff"] == pytest.approx(0.0005)
    assert m["audit/replica/127.0.0.1:8002/tokens"] == 4
    # The verdict is on the mean of each (replica, version): B's v3 tokens differ by 0.25 / 3.
    line = tally.verdict(1e-3, prefix="run-ab12", dtype="float32")
    assert line is not None and "\n" not in line
    assert f"replica {B} " in line and "version 3 (run-ab12-v3)" in line
    assert "by 0.0833 on average over 3 tokens (at most 0.2;" in line
    assert "tolerance 0.001 for float32" in line and A not in line and "other replica" not in line
    assert tally.verdict(0.09) is None
    assert "1 other replica(s) too" in (tally.verdict(1e-4) or "")
    with pytest.raises(ValueError, match="2 recomputed logprobs for 3"):
        tally.add(good, 0, [0.0, 0.0])


def test_a_nan_recomputed_logprob_fails_the_audit() -> None:
    tally = AuditTally()
    tally.add(_sample("n", A, n=1), 0, [math.nan])
    assert tally.verdict(1e9) is not None


def test_episode_names_the_replicas_that_served_it() -> None:
    def ep(replicas: list[str | None] | None) -> Episode:
        return Episode(
            prompt_ids=[1], completion_ids=[2], logprobs=[0.0], version=0, replicas=replicas
        )

    assert ep([A]).served_by == A
    assert ep([A, A, B, A]).served_by == f"{A}+{B}"
    assert ep([None]).served_by is None and ep(None).served_by is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("action", "maybe", "trainer.audit.action='maybe'"),
        ("every", 0, "trainer.audit.every=0"),
        ("samples", 0, "trainer.audit.samples=0"),
        ("tolerance", 0.0, "trainer.audit.tolerance=0"),
    ],
)
def test_bad_audit_settings_are_one_line_errors(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AuditConfig(**{key: value})


def test_tolerance_by_dtype() -> None:
    assert AuditConfig().tolerance_for("float32") == 1e-3
    assert AuditConfig().tolerance_for("bfloat16") > 1e-3
    assert AuditConfig(tolerance=0.02).tolerance_for("float32") == 0.02


# -- on a real tiny trainer -----------------------------------------------------------------------
def _trainer(model_dir, **audit):
    from asyncgrpo.trainer.loop import Trainer

    cfg = TrainerConfig(
        learning_rate=5e-2,
        token_budget=256,
        max_steps=5,
        dtype="float32",
        audit=AuditConfig(**audit),
    )
    return Trainer(model_dir, lora=LoraConfig(r=4, alpha=8.0), trainer=cfg, device="cpu")


def _served(trainer, samples, replica):
    """``samples`` as a replica would serve them: the trainer's current logprobs, tagged."""
    lps = trainer.logprobs(samples)
    return [
        dataclasses.replace(s, logprobs=lp, replica=replica)
        for s, lp in zip(samples, lps, strict=True)
    ]


def test_logprobs_at_a_saved_version_and_the_weights_restored(tiny_model_dir, tmp_path) -> None:
    import torch

    trainer = _trainer(tiny_model_dir)
    samples = make_samples(6, seed=1)
    v0 = trainer.save_adapter(tmp_path / "v0", version=0)
    before = trainer.logprobs(samples)
    trainer.step(samples)
    after = [p.detach().clone() for p in trainer.params]
    assert trainer.logprobs(samples) != before  # the step moved the policy
    again = trainer.logprobs_at(samples, v0)
    assert (
        max(
            abs(a - b)
            for x, y in zip(again, before, strict=True)
            for a, b in zip(x, y, strict=True)
        )
        < 1e-6
    )
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, after, strict=True))
    trainer.step(samples)  # the optimizer still drives the same parameters


def test_the_run_audit_stops_naming_the_replica_that_served_other_weights(
    tiny_model_dir, tmp_path
) -> None:
    trainer = _trainer(tiny_model_dir, samples=6)
    samples = make_samples(6, seed=2)
    v0 = trainer.save_adapter(tmp_path / "v0", version=0)
    right = _served(trainer, samples[:3], A)
    trainer.step(samples)  # B's logprobs come from weights one step on: not v0's
    wrong = _served(trainer, samples[3:], B)
    dirs = {0: v0}

    warn = ServedPolicyAudit(AuditConfig(action="warn", samples=6), trainer, dirs.get, prefix="r")
    warn.observe(right + wrong)
    metrics = anyio.run(warn.after_sync)
    assert metrics["audit/replica/127.0.0.1:8001/max_abs_logprob_diff"] < 1e-5
    assert metrics["audit/replica/127.0.0.1:8002/max_abs_logprob_diff"] > 1e-2
    assert metrics["audit/tokens"] == sum(s.num_policy_tokens for s in samples)

    stop = ServedPolicyAudit(AuditConfig(samples=6, every=2), trainer, dirs.get, prefix="r")
    stop.observe(right + wrong)
    assert anyio.run(stop.after_sync) == {}  # every=2: not this sync
    with pytest.raises(AuditError, match=rf"replica {B} serves other weights than version 0 "):
        anyio.run(stop.after_sync)

    off = ServedPolicyAudit(AuditConfig(action="off"), trainer, dirs.get)
    off.observe(right + wrong)
    assert anyio.run(off.after_sync) == {}
