"""Where a launch's runs keep their metrics: what ``asyncgrpo launch`` prints at the end, and
how ``asyncgrpo plot`` finds them from a launch directory (a sweep's: every point)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo.cli.launch import metrics_lines
from asyncgrpo.cli.plot import find_metrics, plot_runs
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.jobs import Job, JobSpec
from asyncgrpo.launch.manifest import manifest, trainer_metrics
from asyncgrpo.run.metrics import MetricsWriter


def trainer(name: str) -> Job:
    spec = JobSpec(role="trainer", name=f"{name}-trainer", command=("true",))
    return Job(spec, f"id-{name}", Path(f"{name}.log"))


def sweep_launch(tmp_path: Path, points: int, *, written: int | None = None) -> Path:
    """A sweep's launch directory: its manifest, and the metrics of its first ``written``
    points (default: every point)."""
    launch_dir = tmp_path / "runs" / "sw" / "launch"
    paths = {}
    for i in range(points):
        paths[f"sw-{i}-trainer"] = (
            launch_dir / "trainer" / str(i) / "runs" / f"sw-{i}" / ("metrics.jsonl")
        )
        if i < (points if written is None else written):
            with MetricsWriter(paths[f"sw-{i}-trainer"].parent) as w:
                for step in (1, 2):
                    w.log({"reward": step / 4, "ratio": 1.0}, step=step)
    replica = Job(JobSpec(role="replica", name="sw-replica-0", command=("true",)), "r", Path("r"))
    jobs = [replica, *(trainer(f"sw-{i}") for i in range(points))]
    doc = manifest("local", jobs, paths, base=launch_dir)
    launch_dir.mkdir(parents=True, exist_ok=True)
    (launch_dir / "jobs.json").write_text(json.dumps(doc))
    return launch_dir


def test_the_manifest_names_each_trainers_metrics(tmp_path: Path) -> None:
    doc = manifest("hf-jobs", [trainer("a"), trainer("b")], {"a-trainer": tmp_path / "m.jsonl"})
    assert trainer_metrics(json.loads(json.dumps(doc))) == {"a": tmp_path / "m.jsonl"}


def test_plot_on_a_sweeps_launch_directory_draws_every_point(tmp_path: Path) -> None:
    launch_dir = sweep_launch(tmp_path, 2)
    for given in (launch_dir, launch_dir.parent):
        assert set(find_metrics(given)) == {"sw-0", "sw-1"}
    plots = plot_runs(launch_dir)
    assert list(plots) == ["sw-0", "sw-1"]
    for i, png in enumerate(plots.values()):
        assert png == launch_dir / "trainer" / str(i) / "runs" / f"sw-{i}" / "plot.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the paths inside the launch directory are relative: a moved launch still finds them
    doc = json.loads((launch_dir / "jobs.json").read_text())
    assert {j["metrics"] for j in doc["jobs"] if "metrics" in j} == {
        f"trainer/{i}/runs/sw-{i}/metrics.jsonl" for i in (0, 1)
    }
    moved = launch_dir.parent.rename(tmp_path / "elsewhere") / "launch"
    assert set(find_metrics(moved)) == {"sw-0", "sw-1"}
    # a point that wrote nothing yet is left out; none at all names where they would be
    assert set(find_metrics(sweep_launch(tmp_path / "2", 2, written=1))) == {"sw-0"}
    with pytest.raises(ConfigError, match=r"no metrics.jsonl yet \(expected: .*sw-0/metrics"):
        find_metrics(sweep_launch(tmp_path / "3", 1, written=0))


def test_plot_of_a_directory_that_is_neither_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="or a launch directory"):
        find_metrics(tmp_path)
    for text in ("{not json", "[]", '{"jobs": 3}'):
        (tmp_path / "jobs.json").write_text(text)
        with pytest.raises(ConfigError, match=r"jobs\.json is not a launch manifest"):
            find_metrics(tmp_path)
    (tmp_path / "jobs.json").write_text(json.dumps(manifest("hf-jobs", [trainer("r")], {})))
    with pytest.raises(ConfigError, match="wrote theirs on their own machines"):
        find_metrics(tmp_path)


def test_the_launchs_last_lines_say_where_each_runs_metrics_are(tmp_path: Path) -> None:
    launch_dir = tmp_path / "runs" / "r" / "launch"
    one = launch_dir / "trainer" / "runs" / "r" / "metrics.jsonl"
    assert metrics_lines({"r": one}, launch_dir) == [
        f"metrics: {one} (plot: asyncgrpo plot {launch_dir})"
    ]
    points = {f"r-{i}": launch_dir / "trainer" / str(i) / f"r-{i}.jsonl" for i in (0, 1)}
    assert metrics_lines(points, launch_dir) == [
        f"metrics of r-0: {points['r-0']}",
        f"metrics of r-1: {points['r-1']}",
        f"plot every run: asyncgrpo plot {launch_dir}",
    ]
    assert metrics_lines({"r": None}, launch_dir) == [
        "metrics of r: on its trainer job's machine, not on this host"
    ]
