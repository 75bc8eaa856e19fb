"""The fault bench's invariant checkers, each shown to catch its violation on records fed by
hand (and to pass the same records without it): a sample trained twice, a batch lost, a version
deleted or published twice, a metrics row duplicated or missing, an audit failing outside a
fault window, a result outside the clean band."""

from __future__ import annotations

import json
from pathlib import Path

from asyncgrpo.run.ledger import Ledger, lineage, read_ledger
from asyncgrpo.testing.invariants import (
    FaultWindow,
    check_audits,
    check_band,
    check_metrics,
    check_samples,
    check_versions,
)
from asyncgrpo.testing.samples import sample

BATCHES = {seq: [f"p-{seq}-{j}" for j in range(4)] for seq in range(4)}
SHIPPED = [{"event": "shipped", "seq": s, "life": "r1", "ids": ids} for s, ids in BATCHES.items()]


def step(n: int, trained: list[str], dropped: list[str] = (), life: str = "t1") -> dict:
    return {
        "event": "trained",
        "step": n,
        "life": life,
        "version": n,
        "trained": list(trained),
        "dropped_stale": [[i, 0] for i in dropped],
    }


def clean_history() -> list[dict]:
    """Three steps of four samples, batch 3 read in part (left over at the end)."""
    return [
        step(1, BATCHES[0]),
        step(2, BATCHES[1][:2], dropped=BATCHES[1][2:]),
        step(3, BATCHES[2]),
        step(4, BATCHES[3][:1]),
    ]


def names(violations) -> set[str]:
    return {v.invariant for v in violations}


def test_a_clean_history_holds() -> None:
    report = check_samples(BATCHES, SHIPPED, clean_history())
    assert report.violations == []
    assert (report.shipped, report.trained, report.dropped_stale, report.left_over) == (
        16,
        11,
        2,
        3,
    )


def test_a_sample_fed_twice_is_caught() -> None:
    history = clean_history()
    history[2]["trained"][0] = BATCHES[0][1]  # step 3 trains a sample step 1 trained
    assert "trained at most once" in names(check_samples(BATCHES, SHIPPED, history).violations)


def test_steps_redone_after_a_restart_are_not_trained_twice() -> None:
    """Life t1 trained steps 1-3 and died; t2 resumed from the checkpoint of step 1 and trained
    steps 2 and 3 again on the same samples: its lines replace t1's."""
    redone = [step(2, BATCHES[1][:2], BATCHES[1][2:], life="t2"), step(3, BATCHES[2], life="t2")]
    history = [*clean_history()[:3], *redone]
    kept, _ = lineage(history)
    assert [(r["step"], r["life"]) for r in kept] == [(1, "t1"), (2, "t2"), (3, "t2")]
    report = check_samples(BATCHES, SHIPPED, history)
    assert report.violations == [] and report.rolled_back_steps == 2


def test_a_lost_sample_is_caught() -> None:
    history = clean_history()
    history[1]["dropped_stale"] = history[1]["dropped_stale"][
        :1
    ]  # p-1-3: neither trained nor dropped
    violations = check_samples(BATCHES, SHIPPED, history).violations
    assert [v.invariant for v in violations] == ["none lost"] and "p-1-3" in str(violations[0])


def test_an_acknowledged_batch_missing_from_the_store_is_caught() -> None:
    batches = {s: ids for s, ids in BATCHES.items() if s != 3}
    violations = check_samples(batches, SHIPPED, clean_history()[:3]).violations
    assert "none lost" in names(violations) and "batch 3" in str(violations[0])
    # quarantined batches are accounted for
    report = check_samples(
        BATCHES, SHIPPED, [*clean_history()[:2], step(3, BATCHES[3])], quarantined={2}
    )
    assert report.violations == [] and report.quarantined == 4


def test_a_sample_no_batch_holds_is_caught() -> None:
    history = clean_history()
    history[0]["trained"].append("forged-0")
    assert "only shipped samples trained" in names(
        check_samples(BATCHES, SHIPPED, history).violations
    )


def test_a_version_deleted_or_published_twice_is_caught() -> None:
    files = {v: {"adapter_model.safetensors": f"sha-{v}"} for v in range(3)}
    published = [
        {"event": "published", "version": v, "life": "t1", "step": v, "files": files[v]}
        for v in range(3)
    ]
    assert check_versions(published, files, {}) == ([], [])
    gone = {v: f for v, f in files.items() if v != 1}
    assert names(check_versions(published, gone, {})[0]) == {
        "every published version in the store",
        "no hole in the version numbers",
    }
    twice = [*published, {**published[2], "life": "t2"}]
    assert names(check_versions(twice, files, {})[0]) == {"no version name reused"}
    tampered = {**files, 2: {"adapter_model.safetensors": "sha-other"}}
    assert names(check_versions(published, tampered, {2: "sha256 mismatch"})[0]) == {
        "every published version in the store",
        "every version verifies",
    }
    # a version in the store that no line claims: its publisher died after the manifest landed
    assert check_versions(published[:2], files, {}) == ([], [2])


def test_a_duplicated_or_missing_metrics_row_is_caught() -> None:
    rows = [{"step": s} for s in range(1, 6)]
    assert check_metrics(rows, 5) == []
    assert names(check_metrics([*rows, {"step": 3}], 5)) == {"one metrics row per step"}
    assert names(check_metrics(rows[:2] + rows[3:], 5)) == {"no gap in the metrics"}


def test_an_audit_failure_outside_a_fault_window_is_caught() -> None:
    key = "audit/replica/127.0.0.1:8001/mean_abs_logprob_diff"
    rows = [
        {"step": 1, "time": 100.0, key: 1e-6},
        {"step": 2, "time": 200.0, key: 0.5},
        {"step": 3, "time": 300.0},
    ]
    window = FaultWindow("kill replica 127.0.0.1:8001", 190.0, 195.0)
    inside = check_audits(rows, [window], 1e-3, grace_s=10)
    assert (inside.audits, inside.passed, inside.violations) == (2, 1, [])
    assert inside.explained == [
        "step 2: replica 127.0.0.1:8001 off by 0.5 during kill replica 127.0.0.1:8001"
    ]
    outside = check_audits(rows, [FaultWindow("proxy", 10.0, 20.0)], 1e-3, grace_s=10)
    assert names(outside.violations) == {"the served-policy audit passes outside faults"}


def test_a_result_outside_the_clean_band_is_caught() -> None:
    assert check_band("reward", 0.95, [0.97, 0.99, 1.0], margin=0.05) == []
    assert names(check_band("reward", 0.80, [0.97, 0.99, 1.0], margin=0.05)) == {
        "reward within the clean band"
    }
    assert check_band("reward", float("nan"), [1.0], margin=0.05)


def test_the_ledger_keeps_a_line_it_could_not_write(tmp_path: Path) -> None:
    """A full disk delays a line, never loses it; a torn last line is skipped."""
    path = tmp_path / "run" / "samples.jsonl"
    ledger = Ledger(path)
    path.mkdir(parents=True)  # the write fails (an OSError, as ENOSPC would)
    ledger.trained(1, 0, [sample("g", sample_id="a")], [])
    path.rmdir()
    ledger.trained(2, 0, [sample("g", sample_id="b")], [sample("g", sample_id="c", version=0)])
    with path.open("a") as f:
        f.write('{"event": "trained", "st')  # torn
    records = read_ledger(path)
    assert [(r["step"], r["trained"], r["dropped_stale"]) for r in records] == [
        (1, ["a"], []),
        (2, ["b"], [["c", 0]]),
    ]
    assert {r["life"] for r in records} == {ledger.life}
    assert json.loads(path.read_text().splitlines()[0])["event"] == "trained"
