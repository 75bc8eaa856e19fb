"""Metrics: JSONL writer and reader, NaN-skipping means, and the run plot."""

from __future__ import annotations

import json
import math

import pytest

from asyncgrpo.cli.plot import plot_run
from asyncgrpo.errors import ConfigError
from asyncgrpo.run.metrics import METRICS_FILE, MetricsBuffer, MetricsWriter, nanmean, read_metrics
from asyncgrpo.run.trackers import TrackioTracker


def test_nanmean_skips_nan_and_none():
    assert nanmean([1.0, math.nan, 3.0, None]) == 2.0
    assert math.isnan(nanmean([math.nan]))
    assert math.isnan(nanmean([]))


def test_buffer_means():
    buf = MetricsBuffer()
    buf.update({"reward": 1.0, "ratio": 1.0})
    buf.update({"reward": math.nan, "ratio": 0.5})
    buf.add("reward", 0.0)
    assert buf.means() == {"reward": 0.5, "ratio": 0.75}
    buf.clear()
    assert buf.means() == {}


def test_writer_appends_one_valid_json_object_per_step(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.log({"reward": 0.5, "kl": math.nan, "perf/step_s": 1.25}, step=1)
        w.log({"reward": 0.7, "kl": 0.01}, step=2)
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # strict JSON: NaN was written as null
    assert first["step"] == 1 and first["kl"] is None and first["perf/step_s"] == 1.25
    assert "NaN" not in lines[0]
    # A resumed run appends; a replayed step replaces the earlier record when read.
    with MetricsWriter(tmp_path) as w:
        w.log({"reward": 0.9}, step=2)
        w.log({"reward": 1.0}, step=3)
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 4, "rew')  # torn by a crash
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert math.isnan(records[0]["kl"])
    assert records[1]["reward"] == 0.9


def test_writer_without_jsonl_writes_nothing(tmp_path):
    with MetricsWriter(tmp_path / "run", jsonl=False) as w:
        w.log({"reward": 1.0}, step=1)
    assert not (tmp_path / "run").exists()


def test_trackio_missing_is_a_config_error(tmp_path):
    try:
        import trackio  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install trackio"):
            TrackioTracker(project=None, run_name="r", config={})
    else:  # installed: it must accept our records
        tracker = TrackioTracker(project="asyncgrpo-test", run_name="r", config={})
        with MetricsWriter(tmp_path, trackers=[tracker]) as w:
            w.log({"reward": 1.0}, step=1)


class _Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.finished = 0

    def log(self, metrics, *, step):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished += 1


def test_trackers_get_the_finite_numbers_of_each_record_and_finish_once(tmp_path):
    recorder = _Recorder()
    with MetricsWriter(tmp_path, trackers=[recorder]) as w:
        w.log({"reward": 0.5, "kl": math.nan, "ok": True, "name": "x", "n": 3}, step=1)
    w.close()
    assert recorder.logged == [(1, {"reward": 0.5, "n": 3.0})]
    assert recorder.finished == 1


def test_an_evaluation_mirrored_late_never_sends_a_step_back(tmp_path):
    """An evaluation of the version published at step 2 ends at step 5: the trackers get it at
    step 5 (W&B drops a record whose step goes back), its version in ``eval/version``."""
    recorder = _Recorder()
    with MetricsWriter(tmp_path, jsonl=False, trackers=[recorder]) as w:
        w.mirror({"eval/version": 0.0}, step=0)
        for step in range(1, 6):
            w.log({"reward": 0.5}, step=step)
        w.mirror({"eval/version": 2.0}, step=2)
        w.log({"reward": 0.5}, step=6)
    steps = [s for s, _ in recorder.logged]
    assert steps == [0, 1, 2, 3, 4, 5, 5, 6]
    assert recorder.logged[6] == (5, {"eval/version": 2.0})


def test_plot_run_writes_png(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(1, 11):
            w.log(
                {
                    "reward": step / 10,
                    "reward_std": 0.1,
                    "ratio": 1.0,
                    "perf/step_s": 2.0,
                    "sample/staleness_mean": 1.0 if step > 1 else math.nan,
                    "sample/staleness_max": 2.0,
                    "off_policy/staleness_0/tokens": 0.5,
                    "off_policy/staleness_1/tokens": 0.5,
                    "off_policy/staleness_1/weight_mean": 1.1,
                    "off_policy/staleness_1/weight_max": 3.0,
                    "off_policy/masked": 0.01,
                    **({"off_policy/staleness_0/weight_max": 1.0} if step % 3 else {}),
                },
                step=step,
            )
    out = plot_run(tmp_path)
    assert out == tmp_path / "plot.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_plot_draws_held_out_reward_and_pass_at_k_against_the_version(tmp_path):
    """With ``eval_metrics.jsonl``, one more row: reward and pass@1 / pass@k, x the version
    evaluated (not the trainer's step: an evaluation of version 4 may end at step 6)."""
    import json
    import struct

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncgrpo.cli.plot import _eval_panels
    from asyncgrpo.evaluation.records import EVAL_METRICS_FILE, read_evals

    with MetricsWriter(tmp_path) as w:
        for step in range(1, 7):
            w.log({"reward": step / 10}, step=step)
    height = lambda png: struct.unpack(">II", png.read_bytes()[16:24])[1]  # noqa: E731
    without = height(plot_run(tmp_path))
    evals = [(0, 0, 0.1, 0.5), (4, 6, 0.3, 0.75), (6, 6, 0.4, 1.0)]  # version, step, r, pass@2
    with (tmp_path / EVAL_METRICS_FILE).open("w") as f:
        for version, step, reward, p2 in evals:
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "eval/version": version,
                        "eval/reward": reward,
                        "eval/reward_std": 0.1,
                        "eval/pass@1": reward,
                        "eval/pass@2": p2,
                    }
                )
                + "\n"
            )
    assert height(plot_run(tmp_path)) > without
    fig, axes = plt.subplots(1, 2)
    _eval_panels(axes, read_evals(tmp_path))
    ((x, y),) = [line.get_data() for line in axes[0].get_lines()]
    assert list(x) == [0, 4, 6] and list(y) == [0.1, 0.3, 0.4]
    drawn = {line.get_label(): list(line.get_ydata()) for line in axes[1].get_lines()}
    assert drawn == {"pass@1": [0.1, 0.3, 0.4], "pass@2": [0.5, 0.75, 1.0]}
    plt.close(fig)


def test_a_ratio_near_one_is_labelled_by_value_not_by_an_offset() -> None:
    """The ratio panel of a float32 run spans 1 +- 1e-7: matplotlib would label it ``1e-7+1``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncgrpo.cli.plot import _plain_ticks

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [1 - 1e-7, 1.0, 1 + 1e-7])
    _plain_ticks(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    plt.close(fig)
    assert ax.yaxis.get_offset_text().get_text() == ""
    assert all(label.startswith(("0.9999", "1.0000")) for label in labels), labels


def test_a_resumed_writer_drops_the_lines_it_trains_again(tmp_path):
    """Stopped at step 14 with a checkpoint at step 10: the rerun trains 11-14 again, and the
    file holds each step once (a torn last line dropped too)."""
    with MetricsWriter(tmp_path) as writer:
        for step in range(1, 15):
            writer.log({"reward": 0.0}, step=step)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 15, "rew')  # killed mid-write
    with MetricsWriter(tmp_path, after_step=10) as writer:
        for step in range(11, 16):
            writer.log({"reward": 1.0}, step=step)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 16))
    assert [r["reward"] for r in lines] == [0.0] * 10 + [1.0] * 5
    with MetricsWriter(tmp_path, after_step=0):  # a fresh start over an old run's file
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_checkpointed_steps_line_a_killed_run_never_wrote_is_written_from_the_checkpoint(
    tmp_path,
):
    """Killed between its checkpoint of step 6 and that step's line: the rerun resumes after
    step 6, so it writes step 6's line from the checkpoint, once."""
    with MetricsWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.log({"reward": 0.0}, step=step)
    with MetricsWriter(tmp_path, after_step=6, restore={"reward": 0.5}) as writer:
        for step in (7, 8):
            writer.log({"reward": 1.0}, step=step)
    with MetricsWriter(tmp_path, after_step=8, restore={"reward": 9.0}):  # it has step 8
        pass
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in lines] == [
        *((s, 0.0) for s in range(1, 6)),
        (6, 0.5),
        (7, 1.0),
        (8, 1.0),
    ]


FULL_DISK = r"""
import os, sys
from asyncgrpo.run.metrics import MetricsWriter
from asyncgrpo.run.ledger import Ledger
from asyncgrpo.testing.samples import sample
run = sys.argv[1]
w, ledger = MetricsWriter(run), Ledger(os.path.join(run, "samples.jsonl"))
w.log({"reward": 0.1}, step=1)
ledger.trained(1, 0, [sample("g", sample_id="a")], [])
filler = open(os.path.join(run, "filler"), "wb", buffering=0)
try:
    while True:
        filler.write(b"x" * 4096)

except OSError:
    pass
for step in (2, 3):
    w.log({"reward": 0.2, "pad": "y" * 3000}, step=step)
    ledger.trained(step, 0, [sample("g", sample_id="b" * 100)] * 30, [])
filler.close()
os.unlink(os.path.join(run, "filler"))
w.log({"reward": 0.4}, step=4)
ledger.trained(4, 0, [sample("g", sample_id="c")], [])
w.close()
"""


def test_a_full_disk_delays_rows_and_tears_none(tmp_path):
    """A full disk (a real one: a 1 MiB tmpfs in a private mount namespace) under the metrics
    and the sample ledger: the rows that meet it are written with the next ones once there is
    room; none is missing, and no torn line sits between two whole ones."""
    from full_disk import on_full_disk

    run = tmp_path / "run"
    done = on_full_disk(run, FULL_DISK, then=f" && cp {run}/*.jsonl {tmp_path}/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lines kept for the next write" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
