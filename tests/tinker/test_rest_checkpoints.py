"""The SDK's ``RestClient`` checkpoint calls (listing, lookup by path, ``weights_info``, delete,
TTLs) and ``tinker://`` paths across a service restart, through the real SDK, no vLLM."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TEXT = "12 + 7 = 19"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def own(tiny_model: Path, work: Path, start_service) -> Iterator[object]:
    """A service of the test's own, its transport under ``work``."""
    with start_service(tiny_model, work_dir=str(work)) as served:
        yield served


@pytest.fixture
def clients(own) -> Iterator[tuple[object, object]]:
    import tinker

    service = tinker.ServiceClient(base_url=own.url)
    yield service, tinker.RestClient(base_url=own.url)
    service.close("success").result()


def _trained(service, model: str, rank: int = 2, steps: int = 2):
    from tinker import types

    training = service.create_lora_training_client(base_model=model, rank=rank, seed=1).result()
    ids = training.get_tokenizer().encode(TEXT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training, datum


def _loss(training, datum) -> float:
    return training.forward([datum], "cross_entropy").result().metrics["loss:sum"]


def _state_files(work: Path, run_id: str) -> list[Path]:
    return sorted((work / "store" / "tinker-states" / run_id).glob("step-*/manifest.json"))


def test_saved_states_are_listed_and_found_by_path(clients, own) -> None:
    service, rest = clients
    training, _ = _trained(service, own.model)
    run_id = training.model_id
    first = training.save_state("first", user_metadata={"note": "a"}).result().path
    second = training.save_state("second").result().path
    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("weights/first", "training", first),
        ("weights/second", "training", second),
    ]
    assert listed[0].user_metadata == {"note": "a"} and listed[0].expires_at is None
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    run = rest.get_training_run(run_id).result()
    assert (run.training_run_id, run.base_model, run.lora_rank, run.is_lora) == (
        run_id,
        own.model,
        2,
        True,
    )
    assert run.last_checkpoint.tinker_path == second and run.last_sampler_checkpoint is None
    assert rest.get_training_run_by_tinker_path(first).result().training_run_id == run_id
    assert run_id in [
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    ]
    newest = rest.list_user_checkpoints(limit=1).result()
    assert [c.tinker_path for c in newest.checkpoints] == [second]
    assert newest.cursor.total_count >= 2
    info = rest.get_weights_info_by_tinker_path(first).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp, info.train_attn) == (
        own.model,
        True,
        2,
        True,
        True,
    )
    with pytest.warns(FutureWarning):  # the SDK's deprecated spelling reaches the same routes
        assert service.create_rest_client().get_training_run(run_id).result().lora_rank == 2


def test_a_deleted_checkpoint_is_refused_and_leaves_the_transport(clients, own, work) -> None:
    import tinker

    service, rest = clients
    training, _ = _trained(service, own.model, steps=1)
    path = training.save_state("doomed").result().path
    assert len(_state_files(work, training.model_id)) == 1
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(training.model_id).result().checkpoints == []
    assert _state_files(work, training.model_id) == []
    with pytest.raises(tinker.NotFoundError, match=r"no checkpoint at .*deleted.*list_checkpoints"):
        rest.get_weights_info_by_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):
        service.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):
        rest.delete_checkpoint(training.model_id, "weights/doomed").result()


def test_a_checkpoint_past_its_ttl_is_gone(clients, own, work) -> None:
    import tinker

    service, rest = clients
    training, _ = _trained(service, own.model, steps=1)
    short = training.save_state("short", ttl_seconds=1).result().path
    kept = training.save_state("kept").result().path
    (listed,) = [
        c
        for c in rest.list_checkpoints(training.model_id).result().checkpoints
        if c.tinker_path == short
    ]
    assert listed.expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(kept, 2).result()
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # never expires again
    time.sleep(2.5)
    assert [
        c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints
    ] == [kept]
    with pytest.raises(tinker.NotFoundError, match="past its TTL"):
        service.create_training_client_from_state(short).result()
    assert len(_state_files(work, training.model_id)) == 1  # the expired one's files deleted
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds=0: give 1 to"):
        training.save_state("never", ttl_seconds=0).result()


def test_bad_paths_and_calls_name_the_fix(clients, own) -> None:
    import tinker

    service, rest = clients
    training, _ = _trained(service, own.model, steps=1)
    path = training.save_state("once").result().path
    with pytest.raises(tinker.BadRequestError, match="exists: pass overwrite=True"):
        training.save_state("once").result()
    assert training.save_state("once", overwrite=True).result().path == path
    assert len(rest.list_checkpoints(training.model_id).result().checkpoints) == 1
    with pytest.raises(tinker.BadRequestError, match=r"not a checkpoint path: .*weights/<name>"):
        rest.get_weights_info_by_tinker_path("tinker://run/bogus/x").result()
    with pytest.raises(tinker.NotFoundError, match=r"no training run 'nobody'.*list_training_runs"):
        rest.get_training_run("nobody").result()
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        rest.get_weights_info_by_tinker_path("tinker://nobody/weights/x").result()
    with pytest.raises(tinker.BadRequestError, match=r"publishing is not served: .*one user"):
        rest.publish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.BadRequestError, match="holds sampler weights"):
        service.create_training_client_from_state(
            f"tinker://{training.model_id}/sampler_weights/once"
        ).result()


def test_a_path_loads_after_the_service_restarts(
    tiny_model: Path, tmp_path: Path, start_service
) -> None:
    import tinker

    _serve = start_service
    with _serve(tiny_model, work_dir=str(tmp_path)) as served:
        service = tinker.ServiceClient(base_url=served.url)
        training, datum = _trained(service, served.model, rank=3)
        path = training.save_state("before", ttl_seconds=3600).result().path
        trained, run_id = _loss(training, datum), training.model_id
        service.close("success").result()
    with _serve(tiny_model, work_dir=str(tmp_path)) as served:
        service = tinker.ServiceClient(base_url=served.url)
        rest = tinker.RestClient(base_url=served.url)
        (listed,) = rest.list_checkpoints(run_id).result().checkpoints
        assert listed.tinker_path == path and listed.expires_at is not None
        assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 3
        loaded = service.create_training_client_from_state(path).result()
        assert loaded.get_info().lora_rank == 3
        assert ":" in loaded.model_id  # the SDK's id of a loaded client; its run is found too
        assert rest.get_training_run(loaded.model_id).result().lora_rank == 3
        assert _loss(loaded, datum) == pytest.approx(trained, rel=1e-6)
        service.close("success").result()
