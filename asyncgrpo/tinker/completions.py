"""A ``SampleRequest`` as vLLM ``/v1/completions`` requests, and their answers as the SDK's
``SampleResponse``. Pure: no I/O.

One request carries the samples (``n = num_samples``, each token's logprob, the top-k of each
sampled position with ``topk_sample_logprobs``) and the prompt's logprobs when asked
(``prompt_logprobs``: each prompt token's; ``topk_prompt_logprobs``: the top k at each
position). vLLM scores only the prompt's own tokens, so ``target_prompt_logprobs`` (any token
ids at any prompt position) is a second request: for each asked cell, the prompt up to that
position followed by the asked token, whose last prompt logprob is the cell's answer; prompts
that share a prefix share its KV cache. What the replicas would refuse (a prompt plus
``max_tokens`` past ``--max-model-len``, more top logprobs than ``--max-logprobs``) is refused
here first, naming the limit and the fix, so that vLLM's own error text never reaches a client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo.tinker.wire import SampledSeq, SampleResult, TargetLogprobs, TopK, WireError

__all__ = [
    "MAX_TARGET_CELLS",
    "Ask",
    "Limits",
    "check_sample",
    "completions_body",
    "sample_result",
    "target_body",
    "target_result",
]

#: The most ``target_prompt_logprobs`` cells one request may ask for (one scored prompt each).
MAX_TARGET_CELLS = 4096
#: The SDK's stop reasons for vLLM's finish reasons.
_STOP_REASONS = {"stop": "stop", "length": "length", "abort": "length"}
#: The filler of an empty top-k cell (``tinker.types.topk_logprobs.MASK_LOGPROB``).
MASK_LOGPROB = -99999.0


@dataclass(frozen=True)
class Limits:
    """What the replicas take (None: they did not say, so nothing is checked here)."""

    max_model_len: int | None = None
    max_logprobs: int | None = None


@dataclass(frozen=True)
class Ask:
    """What one ``SampleRequest`` asks for, checked."""

    prompt: list[int]
    num_samples: int
    params: Any
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0
    last_n: int | None = None
    #: ``target_prompt_logprobs``: (rows, cols, token ids) of the asked cells, its dense
    #: shape, and its CSR indices when it came sparse
    targets: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    target_shape: tuple[int, int] | None = None
    target_csr: tuple[np.ndarray, np.ndarray] | None = None


def _fix_len(limit: int) -> str:
    return (
        f"the replicas' --max-model-len is {limit} (prompt and sampled tokens together): "
        "shorten the prompt, lower max_tokens, or start the service with a larger "
        "--max-model-len"
    )


def _targets(
    tensor: Any, prompt_len: int
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, int], Any]:
    """Every cell of a ``target_prompt_logprobs`` tensor (the SDK's ``TensorData``) as
    (rows, columns, token ids), in its layout's order; its dense shape; its CSR indices when
    it came sparse."""
    shape = tensor.shape
    if tensor.dtype != "int64" or shape is None or len(shape) != 2:
        raise WireError(
            "target_prompt_logprobs must be an int64 tensor of shape [len(prompt) - 1, K]"
        )
    rows, k = int(shape[0]), int(shape[1])
    if rows != prompt_len - 1:
        raise WireError(
            f"target_prompt_logprobs has {rows} rows but the prompt has {prompt_len} tokens: "
            "give len(prompt) - 1 rows (row i scores position i + 1)"
        )
    data = np.asarray(tensor.data, dtype=np.int64)
    csr = None
    if tensor.sparse_crow_indices is not None:
        crow = np.asarray(tensor.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(tensor.sparse_col_indices or [], dtype=np.int64)
        ok = (
            len(crow) == rows + 1
            and crow[0] == 0
            and crow[-1] == len(col) == len(data)
            and bool(np.all(np.diff(crow) >= 0))
            and bool(np.all((col >= 0) & (col < k)))
        )
        if not ok:
            raise WireError("target_prompt_logprobs is not a valid sparse CSR tensor of its shape")
        cells = (np.repeat(np.arange(rows), np.diff(crow)), col, data)
        csr = (crow, col)
    else:
        if data.size != rows * k:
            raise WireError(
                f"target_prompt_logprobs holds {data.size} values but its shape is [{rows}, {k}]"
            )
        r, c = np.divmod(np.arange(rows * k), k)
        cells = (r, c, data)
    wanted = int((cells[2] != -1).sum())
    if wanted > MAX_TARGET_CELLS:
        raise WireError(
            f"target_prompt_logprobs asks for {wanted} cells, more than {MAX_TARGET_CELLS} "
            "(each is a scored prompt here): ask for fewer, or send -1 in the cells you do "
            "not need"
        )
    return cells, (rows, k), csr


def check_sample(body: Any, limits: Limits, vocab_size: int | None = None) -> Ask:
    """The :class:`Ask` of a ``SampleRequest``; WireError naming the limit and the fix for
    what the replicas would refuse, or what is not served here."""
    prompt = body.prompt.to_ints()
    params = body.sampling_params
    if not prompt:
        raise WireError("the prompt is empty: give at least one token")
    if not 1 <= body.num_samples <= 1024:
        raise WireError(f"num_samples={body.num_samples}: give 1 to 1024")
    if body.prompt_alt_tokens_k:
        raise WireError(
            "prompt_alt_tokens_k is not served here: vLLM draws tokens only after "
            "the prompt, so a draw at every prompt position would take one request "
            "per position; leave it 0"
        )
    if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise WireError(
            f"the prompt has a token id outside the model's vocabulary [0, {vocab_size})"
        )
    max_len = limits.max_model_len
    if max_len is not None and len(prompt) >= max_len:
        raise WireError(f"the prompt has {len(prompt)} tokens: {_fix_len(max_len)}")
    if params.max_tokens is not None:
        if params.max_tokens < 1:
            raise WireError(f"max_tokens={params.max_tokens}: give at least 1")
        if max_len is not None and len(prompt) + params.max_tokens > max_len:
            raise WireError(
                f"a prompt of {len(prompt)} tokens and max_tokens="
                f"{params.max_tokens} make {len(prompt) + params.max_tokens}: "
                f"{_fix_len(max_len)}"
            )
    for name, k in (
        ("topk_prompt_logprobs", body.topk_prompt_logprobs),
        ("topk_sample_logprobs", body.topk_sample_logprobs),
    ):
        if k < 0:
            raise WireError(f"{name}={k}: give 0 (none) or a positive k")
        if k and limits.max_logprobs is not None and k > limits.max_logprobs:
            raise WireError(
                f"{name}={k}: the replicas return at most {limits.max_logprobs} "
                "top logprobs a position (their --max-logprobs); ask for fewer"
            )
    scored = bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and (not scored or not 1 <= last_n <= len(prompt) - 1):
        raise WireError(
            f"prompt_logprobs_last_n={last_n}: give 1 to len(prompt) - 1 "
            f"({len(prompt) - 1}) with prompt_logprobs=True"
        )
    targets = shape = csr = None
    if body.target_prompt_logprobs is not None:
        targets, shape, csr = _targets(body.target_prompt_logprobs, len(prompt))
        ids = targets[2][targets[2] != -1]
        bad = ids[(ids < 0) | (ids >= (vocab_size or 1 << 62))]
        if bad.size:
            raise WireError(
                f"target_prompt_logprobs asks for token id {int(bad[0])}: give ids "
                f"of the model's vocabulary, or -1 for nothing"
            )
    return Ask(
        prompt=prompt,
        num_samples=body.num_samples,
        params=params,
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt=body.topk_prompt_logprobs,
        topk_sample=body.topk_sample_logprobs,
        last_n=last_n,
        targets=targets,
        target_shape=shape,
        target_csr=csr,
    )


def _sampling(body: dict[str, Any], params: Any) -> dict[str, Any]:
    body.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def completions_body(model: str, ask: Ask) -> dict[str, Any]:
    """The vLLM ``/v1/completions`` body of the samples (and prompt logprobs) ``ask`` wants."""
    params = ask.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": ask.prompt,
        "n": ask.num_samples,
        "logprobs": ask.topk_sample,
        "return_token_ids": True,
    }
    if ask.topk_sample:
        body["return_tokens_as_token_ids"] = True  # top-k keyed by id, not by decoded text
    _sampling(body, params)
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    stop = params.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and len(stop) == 0:
        body["ignore_eos"] = True
    elif stop is not None and all(isinstance(s, int) for s in stop):
        body["stop_token_ids"] = list(stop)
    elif stop is not None:
        body["stop"] = list(stop)
    if ask.prompt_logprobs or ask.topk_prompt:
        body["prompt_logprobs"] = ask.topk_prompt
    return body


def _pairs(ask: Ask) -> list[tuple[int, int]]:
    """The distinct (row, token id) the target cells ask for, in a fixed order."""
    assert ask.targets is not None
    rows, _, ids = ask.targets
    return sorted({(r, t) for r, t in zip(rows.tolist(), ids.tolist(), strict=True) if t != -1})


def target_body(model: str, ask: Ask) -> dict[str, Any]:
    """The ``/v1/completions`` body scoring ``ask``'s target cells: one prompt per distinct
    (row, token), the prompt up to the row's position followed by the token."""
    prompts = [[*ask.prompt[: r + 1], t] for r, t in _pairs(ask)]
    body = {"model": model, "prompt": prompts, "n": 1, "max_tokens": 1, "prompt_logprobs": 0}
    return _sampling(body, ask.params)


def target_result(data: Mapping[str, Any], ask: Ask) -> TargetLogprobs:
    """The ``target_prompt_logprobs`` answer from :func:`target_body`'s completion: the asked
    tensor's shape and layout, 0.0 in the cells that ask for nothing (-1)."""
    assert ask.targets is not None and ask.target_shape is not None
    pairs = _pairs(ask)
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != len(pairs):
        raise RuntimeError(f"the replica scored {len(choices)} of {len(pairs)} target prompts")
    found = {}
    for (r, t), choice in zip(pairs, choices, strict=True):
        entry = (choice.get("prompt_logprobs") or [None])[-1] or {}
        found[(r, t)] = float(entry[str(t)]["logprob"])
    rows, cols, ids = ask.targets
    values = np.asarray(
        [
            found[(r, t)] if t != -1 else 0.0
            for r, t in zip(rows.tolist(), ids.tolist(), strict=True)
        ],
        dtype=np.float32,
    )
    n_rows, k = ask.target_shape
    if ask.target_csr is not None:
        crow, col = ask.target_csr
        return TargetLogprobs(values=values, shape=(n_rows, k), crow=crow, col=col)
    dense = np.zeros((n_rows, k), np.float32)
    dense[rows, cols] = values
    return TargetLogprobs(values=dense.ravel(), shape=(n_rows, k))


def _topk(entries: Mapping[str, Any] | None, k: int, key: str) -> tuple[list[int], list[float]]:
    """The ``k`` most likely (id, logprob) of one position's vLLM entries, best first."""
    if not entries:
        return [], []
    pairs = []
    for name, value in entries.items():
        token = int(name.removeprefix("token_id:"))
        pairs.append((token, float(value[key] if isinstance(value, dict) else value)))
    pairs.sort(key=lambda p: -p[1])
    return [p[0] for p in pairs[:k]], [p[1] for p in pairs[:k]]


def _topk_matrix(rows: list[tuple[list[int], list[float]]], k: int) -> TopK:
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    for i, (tok, lp) in enumerate(rows):
        ids[i, : len(tok)] = tok
        lps[i, : len(lp)] = lp
    return TopK(token_ids=ids, logprobs=lps)


def sample_result(data: Mapping[str, Any], ask: Ask) -> SampleResult:
    """The samples of a vLLM completion answer, in the order of its choices, with the prompt
    logprobs ``ask`` wanted (NaN and empty rows where none: position 0, and before the last
    ``prompt_logprobs_last_n``)."""
    sequences = []
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    for choice in choices:
        tokens = choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        token_lps = logprobs.get("token_logprobs") or []
        if len(token_lps) != len(tokens):
            raise RuntimeError("the replica returned no logprob for some sampled tokens")
        topk = None
        if ask.topk_sample:
            tops = logprobs.get("top_logprobs") or [None] * len(tokens)
            topk = _topk_matrix(
                [_topk(t, ask.topk_sample, "logprob") for t in tops], ask.topk_sample
            )
        stop = _STOP_REASONS.get(choice.get("finish_reason"), "length")
        sequences.append(
            SampledSeq(
                tokens=np.asarray(tokens, dtype=np.int32),
                logprobs=np.asarray(token_lps, dtype=np.float32),
                stop_reason=stop,
                topk=topk,
            )
        )
    prompt = ask.prompt
    entries = next((c["prompt_logprobs"] for c in choices if c.get("prompt_logprobs")), [])
    entries = list(entries[: len(prompt)]) + [None] * (len(prompt) - len(entries))
    if ask.last_n is not None:  # scored: the last n only
        entries = [None] * (len(prompt) - ask.last_n) + entries[len(prompt) - ask.last_n :]
    prompt_lp = topk_prompt = None
    if ask.prompt_logprobs:
        prompt_lp = np.full(len(prompt), np.nan, dtype=np.float32)
        for i, entry in enumerate(entries):
            if entry:
                found = entry.get(str(prompt[i])) or next(iter(entry.values()))
                prompt_lp[i] = found["logprob"]
    if ask.topk_prompt:
        topk_prompt = _topk_matrix(
            [_topk(e, ask.topk_prompt, "logprob") for e in entries], ask.topk_prompt
        )
    return SampleResult(sequences=sequences, prompt_logprobs=prompt_lp, topk_prompt=topk_prompt)
