"""A sweep's points and its fleet: pure functions of the config."""

from __future__ import annotations

import pytest

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.sweep import fleet_config, parse_sweep, sweep_points, under


def config(*sweep: str, **extra) -> TrainingConfig:
    data = {
        "model": "m/m",
        "dataset": {"prompts": ["p"]},
        "run_name": "lr",
        "launch": {"sweep": list(sweep)},
        **extra,
    }
    return TrainingConfig.from_dict(data)


def test_every_combination_is_a_run_of_its_own_with_storage_of_its_own() -> None:
    cfg = config(
        "trainer.learning_rate=1e-5,3e-5", "trainer.max_staleness=0,2", trainer={"max_steps": 7}
    )
    points = sweep_points(cfg, "s3://bucket/sweep/")
    assert [p.label for p in points] == [
        "trainer.learning_rate=1e-5 trainer.max_staleness=0",
        "trainer.learning_rate=1e-5 trainer.max_staleness=2",
        "trainer.learning_rate=3e-5 trainer.max_staleness=0",
        "trainer.learning_rate=3e-5 trainer.max_staleness=2",
    ]
    assert [p.cfg.run_name for p in points] == ["lr-0", "lr-1", "lr-2", "lr-3"]
    assert [p.cfg.transport_url for p in points] == [f"s3://bucket/sweep/lr-{i}" for i in range(4)]
    assert [(p.cfg.trainer.learning_rate, p.cfg.trainer.max_staleness) for p in points] == [
        (1e-5, 0),
        (1e-5, 2),
        (3e-5, 0),
        (3e-5, 2),
    ]
    assert all(p.cfg.trainer.max_steps == 7 and p.cfg.launch.sweep == [] for p in points)
    assert points[1].cfg.serve.max_staleness == 2  # each point's own derived settings
    fleet = fleet_config(cfg, points)  # windows 2 + 4 + 2 + 4
    assert fleet.serve.lora_slots == 12 and fleet.trainer.max_staleness == 2
    assert fleet.run_name == "lr" and fleet.launch.sweep == cfg.launch.sweep


def test_the_fleet_holds_the_version_each_points_evaluation_pins() -> None:
    cfg = config("lora.r=1,16", eval={"prompts": ["q"], "every": 5})
    points = sweep_points(cfg, None)
    assert [p.cfg.serve.pinned_versions for p in points] == [1, 1]
    assert fleet_config(cfg, points).serve.lora_slots == 2 * (4 + 2 + 1)


def test_the_fleet_takes_the_largest_rank_and_a_storage_query_stays_at_the_end() -> None:
    points = sweep_points(config("lora.r=1,16"), None)
    assert [p.cfg.transport_url for p in points] == [None, None]
    fleet = fleet_config(config("lora.r=1,16"), points)
    assert fleet.serve.lora_rank == 16 and fleet.serve.lora_slots == 2 * (4 + 2)
    assert under("az://c/runs?sv=1&sig=x", "lr-0") == "az://c/runs/lr-0?sv=1&sig=x"
    one = config()
    assert (
        sweep_points(one, None)[0].cfg is one and fleet_config(one, sweep_points(one, None)) is one
    )


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("trainer.learning_rate", "write KEY=V1,V2"),
        ("trainer.learning_rate=1e-5,", "write KEY=V1,V2"),
        ("=1,2", "write KEY=V1,V2"),
        ("model=a,b", "model cannot be swept"),
        ("serve.dtype=float32,bfloat16", "serve.dtype cannot be swept"),
        ("launch.replicas=1,2", "launch.replicas cannot be swept"),
        ("run_name=a,b", "run_name cannot be swept"),
        ("seed=1,1", "given twice"),
    ],
)
def test_a_sweep_that_cannot_be_run_is_refused_naming_the_entry(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_sweep([entry])


def test_a_bad_value_names_its_point_and_key() -> None:
    with pytest.raises(ConfigError, match=r"sweep point 1 \(trainer.learning_rate=fast\).*number"):
        sweep_points(config("trainer.learning_rate=1e-5,fast"), None)
    with pytest.raises(ConfigError, match="unknown"):
        sweep_points(config("trainer.learning_rat=1,2"), None)
    with pytest.raises(ConfigError, match="given twice"):
        parse_sweep(["seed=1,2", "seed=3"])
