"""Sampler weights and sampling through the proxy on two real vLLM replicas, via the SDK.

The served-policy proof: the logprobs ``sample`` returns equal the training client's
``forward`` logprobs of the same tokens at the same weights (float32 on both sides).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.vllm  # real vLLM replicas


def _train(training, tokenizer, steps: int) -> None:
    from tinker import types

    ids = tokenizer.encode("12 + 7 = 19")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def test_sampled_logprobs_equal_the_training_clients_forward(fleet, tiny_model: Path) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=fleet)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    tokenizer = training.get_tokenizer()
    _train(training, tokenizer, steps=3)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("12 + 7 =")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    response = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    assert len(response.sequences) == 4
    base = service.create_sampling_client(base_model=str(tiny_model)).result()
    base_seq = base.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    gaps, moved = [], []
    for seq in response.sequences:
        full = prompt + list(seq.tokens)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:]},
        )
        out = training.forward([datum], "cross_entropy").result()
        trained = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        gaps.append(np.abs(trained - np.asarray(seq.logprobs)).max())
        if list(seq.tokens) == list(base_seq.tokens):
            moved.append(np.abs(np.asarray(seq.logprobs) - np.asarray(base_seq.logprobs)).max())
    assert max(gaps) <= 1e-4, gaps
    assert all(m > 1e-3 for m in moved), moved  # the adapter, not the base model, was served
    full = prompt + list(response.sequences[0].tokens)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:]},
    )
    forward = training.forward([datum], "cross_entropy").result()
    expected = forward.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(np.asarray(scored[1:]) - expected).max() <= 1e-4
    service.close("success").result()


def test_saved_paths_and_unknown_ones(fleet, tiny_model: Path) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=fleet)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=2).result()
    _train(training, training.get_tokenizer(), steps=1)
    path = training.save_weights_for_sampler("step-1").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/step-1")
    sampler = service.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    seqs = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, params).result().sequences
    assert [len(s.tokens) for s in seqs] == [len(s.logprobs) for s in seqs]
    with pytest.raises(tinker.NotFoundError, match=r"no checkpoint at .*no training run 'nope'"):
        service.create_sampling_client(model_path="tinker://nope/sampler_weights/x").result()
    service.close("success").result()


def test_a_version_that_left_the_replicas_is_loaded_back_to_sample(
    fleet, tiny_model: Path, vllm_replicas: list
) -> None:
    """``sampler_keep=1``: saving v2 retires v1 from the replicas; v1's sampling client then
    loads it back from the transport and scores v1's own sample as v1 did (so the weights
    served are v1's, not v2's), and saving v3 retires it again (the slots stay bounded)."""
    import httpx
    import tinker
    from tinker import types

    def served() -> set[str]:
        names = set()
        for replica in vllm_replicas:
            names |= {m["id"] for m in httpx.get(f"{replica.url}/v1/models").json()["data"]}
        return names

    service = tinker.ServiceClient(base_url=fleet)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    tokenizer = training.get_tokenizer()
    _train(training, tokenizer, steps=2)
    first = training.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("12 + 7 =")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    seq = first.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    full = types.ModelInput.from_ints(prompt + list(seq.tokens))
    before = np.asarray(first.compute_logprobs(full).result()[len(prompt) :])
    v1 = {n for n in served() if n.endswith("-v1")}
    assert len(v1) == 1 and np.abs(before - np.asarray(seq.logprobs)).max() <= 1e-4
    _train(training, tokenizer, steps=2)
    second = training.save_weights_and_get_sampling_client().result()
    assert not v1 & served(), "v1 should have left the replicas (sampler_keep=1)"
    after = np.asarray(first.compute_logprobs(full).result()[len(prompt) :])
    assert v1 <= served()
    assert np.abs(after - before).max() <= 1e-4, "v1 loaded back is not v1"
    now = np.asarray(second.compute_logprobs(full).result()[len(prompt) :])
    assert np.abs(now - before).max() > 1e-3  # v2 differs: the check above could fail
    training.save_weights_for_sampler("v3").result()
    assert not v1 & served(), "the version loaded back stays only until the next save"
    service.close("success").result()


def test_sampler_paths_are_listed_outlive_their_client_and_are_deleted(
    fleet, tiny_model: Path, vllm_replicas: list, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A ``save_weights_for_sampler`` path is listed as a sampler checkpoint; after its training
    client ended (as after a restart: no live client, only the index), a new sampling client of
    it loads the version back and scores as before; deleted, it is refused and leaves the
    store."""
    import tinker
    from tinker import types

    service, rest = tinker.ServiceClient(base_url=fleet), tinker.RestClient(base_url=fleet)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    tokenizer = training.get_tokenizer()
    _train(training, tokenizer, steps=2)
    path = training.save_weights_for_sampler("kept", ttl_seconds=3600).result().path
    run_id = training.model_id
    (listed,) = rest.list_checkpoints(run_id).result().checkpoints
    assert (listed.checkpoint_type, listed.tinker_path) == ("sampler", path)
    assert listed.expires_at is not None and listed.size_bytes > 0
    assert rest.get_training_run(run_id).result().last_sampler_checkpoint.tinker_path == path
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    full = types.ModelInput.from_ints(tokenizer.encode("12 + 7 = 19"))
    first = service.create_sampling_client(model_path=path).result()
    before = np.asarray(first.compute_logprobs(full).result()[1:])
    service.close("success").result()  # the client ends: its versions leave the replicas
    _wait_gone(vllm_replicas, f"{run_id}-v")
    other = tinker.ServiceClient(base_url=fleet)
    again = other.create_sampling_client(model_path=path).result()
    after = np.asarray(again.compute_logprobs(full).result()[1:])
    assert np.abs(after - before).max() <= 1e-4
    base = tmp_path_factory.getbasetemp()
    stored = sorted(base.glob(f"tinker-work*/store/adapters/{run_id}/v1/manifest.json"))
    assert stored, f"no stored v1 of {run_id} under {base}"
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert not [p for p in stored if p.exists()], stored
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):
        other.create_sampling_client(model_path=path).result()
    other.close("success").result()


def _wait_gone(replicas: list, prefix: str, timeout_s: float = 60.0) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = {m["id"] for r in replicas for m in httpx.get(f"{r.url}/v1/models").json()["data"]}
        if not any(n.startswith(prefix) for n in names):
            return
        time.sleep(0.2)
    raise AssertionError(f"{prefix}* still served after {timeout_s:g} s")


def _rl_datum(prompt: list[int], seq, advantage: float):
    """rl_loop's datum of one sample, with the provenance it attaches for stable_reinforce."""
    from tinker import types

    tokens = list(seq.tokens)
    n_prompt = len(prompt)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + tokens,
            "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs),
            "advantages": [0.0] * (n_prompt - 1) + [advantage] * len(tokens),
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(tokens)),
        ],
    )


def test_stable_reinforce_trains_on_what_the_sampler_recorded(fleet, tiny_model: Path) -> None:
    """Sampled with record_stability_info, trained with stable_reinforce: the loss is the
    importance-corrected REINFORCE against the recorded logprobs (not the datum's), the
    sampler-vs-trainer gap the step reports is float32 noise, and provenance that does not
    match what was recorded, or names a sequence never recorded, is a BadRequestError."""
    import dataclasses

    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=fleet)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    tokenizer = training.get_tokenizer()
    recorder = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = tokenizer.encode("12 + 7 =")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=4)
    seqs = recorder.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    assert len({s.sequence_id for s in seqs}) == 4
    data = [_rl_datum(prompt, s, a) for s, a in zip(seqs, [1.0, -1.0, 0.5, -0.5], strict=True)]
    # the datum's own logprobs are ignored: zeros here change nothing
    blank = [
        dataclasses.replace(
            d, loss_fn_inputs={**d.loss_fn_inputs, "logprobs": [0.0] * d.model_input.length}
        )
        for d in data
    ]
    out = training.forward_backward(blank, "stable_reinforce").result()
    expected = 0.0
    for seq, datum, o in zip(seqs, data, out.loss_fn_outputs, strict=True):
        logp = o["logprobs"].to_numpy()[len(prompt) - 1 :]
        adv = datum.loss_fn_inputs["advantages"].to_numpy()[len(prompt) - 1 :]
        expected -= float((np.exp(logp - np.asarray(seq.logprobs)) * adv).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert abs(out.metrics["kl_sample_train_v1:mean"]) < 1e-4
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["kl_sample_train_v2:mean"] < 1e-6
    bad = data[0].loss_fn_inputs["target_tokens"].to_numpy().copy()
    bad[-1] = (bad[-1] + 1) % 300
    tampered = dataclasses.replace(
        data[0], loss_fn_inputs={**data[0].loss_fn_inputs, "target_tokens": bad.tolist()}
    )
    with pytest.raises(tinker.BadRequestError, match=r"target_tokens\[\d+\] is .* sampled token"):
        training.forward_backward([tampered], "stable_reinforce").result()
    plain = training.save_weights_and_get_sampling_client().result()  # records nothing
    other = plain.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    with pytest.raises(tinker.BadRequestError, match="record_stability_info=True"):
        training.forward_backward([_rl_datum(prompt, other, 1.0)], "stable_reinforce").result()
    # any other loss takes the same datum, spans and all (rl.train attaches them always)
    training.forward_backward([_rl_datum(prompt, other, 1.0)], "importance_sampling").result()
    service.close("success").result()


def test_topk_and_target_prompt_logprobs_agree_with_the_prompt_logprobs(
    fleet, tiny_model: Path
) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=fleet)
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    tokenizer = (
        service.create_lora_training_client(base_model=str(tiny_model), rank=1)
        .result()
        .get_tokenizer()
    )
    prompt = tokenizer.encode("3 + 4 = 7")
    n = len(prompt)
    # ask, at every position, for the prompt's own token and for token 5
    targets = np.stack([np.asarray(prompt[1:]), np.full(n - 1, 5)], axis=1).astype(np.int64)
    out = sampler.sample(
        types.ModelInput.from_ints(prompt),
        2,
        types.SamplingParams(max_tokens=3, seed=0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        target_prompt_logprobs=tinker.TensorData.from_numpy(targets),
    ).result()
    own = np.asarray(out.prompt_logprobs[1:], dtype=np.float64)
    scored = out.target_prompt_logprobs.to_numpy()
    assert scored.shape == (n - 1, 2)
    assert np.abs(scored[:, 0] - own).max() < 1e-4  # the two ways of scoring agree
    for row, token, lp in zip(out.topk_prompt_logprobs[1:], prompt[1:], own, strict=True):
        values = [v for _, v in row]
        assert len(row) == 3 and values == sorted(values, reverse=True)
        mine = [v for t, v in row if t == token]
        assert mine == [pytest.approx(lp, abs=1e-4)] if mine else lp <= values[-1] + 1e-4
    for seq in out.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for (token, lp), top in zip(
            zip(seq.tokens, seq.logprobs, strict=True), seq.topk_logprobs, strict=True
        ):
            assert top[0][1] >= top[1][1] and top[0][1] >= lp - 1e-4
            if token == top[0][0]:
                assert top[0][1] == pytest.approx(lp, abs=1e-4)
    service.close("success").result()


def test_requests_past_the_replicas_limits_are_bad_requests_naming_them(
    fleet, tiny_model: Path
) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=fleet)
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    with pytest.raises(
        tinker.BadRequestError,
        match=r"max_tokens=5000 make 5003: .*--max-model-"
        r"len is 1024.*lower max_tokens",
    ):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5000)).result()
    with pytest.raises(tinker.BadRequestError, match=r"at most 20 top logprobs .*--max-logprobs"):
        sampler.sample(
            prompt,
            1,
            types.SamplingParams(max_tokens=1),
            topk_prompt_logprobs=50,
            include_prompt_logprobs=True,
        ).result()
    service.close("success").result()
