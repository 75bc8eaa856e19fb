"""Prompts for rollouts: rows from JSONL, an inline list or `datasets`, in a resumable order.

The order is a pure function of ``(seed, position)``: position ``p`` is row
``perm(epoch)[p % N]`` with ``epoch = p // N``, where ``perm(e)`` is a permutation seeded by
``seed`` and ``e``. A resumed run therefore only needs the integer position the trainer
checkpointed, not the iterator state.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.config.rollout import DatasetConfig
from asyncgrpo.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Prompt:
    """One prompt ready to send: its dataset position, the raw prompt and its token ids."""

    index: int
    epoch: int
    prompt: str | list[dict[str, Any]]
    prompt_ids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


def load_tokenizer(model: str | Path) -> Any:
    """The model's tokenizer (and chat template), from its directory or hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of a prompt: chat messages through the template, plain text as is.

    The template is rendered to text, then encoded without special tokens, so the result is
    the same whatever ``apply_chat_template(tokenize=True)`` returns in a transformers version.
    """
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "the prompt is a list of chat messages but the tokenizer has no chat template: "
            "use a model with one, or give plain-text prompts"
        )
    text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _read_rows(config: DatasetConfig) -> list[Any]:
    if config.prompts is not None:
        return list(config.prompts)
    assert config.path is not None
    path = Path(config.path).expanduser()
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return list(json.loads(text))
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"dataset {path}:{lineno} is not valid JSON: {exc}") from exc
        return rows
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            f"dataset.path={config.path!r} is not a local .jsonl/.json file, and loading it as a "
            "`datasets` name needs `pip install datasets`"
        ) from exc
    ds = datasets.load_dataset(config.path, name=config.subset, split=config.split)
    return ds.to_list()


def read_rows(config: DatasetConfig) -> list[Any]:
    """The rows of a dataset section, unshuffled."""
    return _read_rows(config)


def local_rows(config: DatasetConfig) -> list[Any] | None:
    """The rows of a dataset this host holds (inline prompts, a local .jsonl/.json file), each
    checked for its prompt column: what a run would refuse minutes later, refused in
    milliseconds. None for a `datasets` name, which only a real start loads (a download)."""
    if config.prompts is None:
        assert config.path is not None
        path = Path(config.path).expanduser()
        if not (path.is_file() and path.suffix in (".jsonl", ".json")):
            return None
    rows = _read_rows(config)
    for i, row in enumerate(rows):
        _normalise(row, config.prompt_column, i)
    if not rows:
        raise ConfigError(f"dataset {config.path}: no rows")
    return rows


def split_rows(rows: Sequence[Any], share: float, *, seed: int) -> tuple[list[Any], list[Any]]:
    """(training rows, held-out rows): ``ceil(share * len(rows))`` rows chosen by ``seed`` are
    held out (at least one, and at least one left to train on); both keep the rows' order, and
    the choice depends only on the row count, the share and the seed."""
    n = len(rows)
    if n < 2:
        raise ConfigError(f"eval.holdout needs at least 2 training rows; the dataset has {n}")
    count = min(max(1, math.ceil(share * n)), n - 1)
    held = set(random.Random(f"asyncgrpo:holdout:{seed}").sample(range(n), count))
    return [r for i, r in enumerate(rows) if i not in held], [
        r for i, r in enumerate(rows) if i in held
    ]


def _normalise(row: Any, column: str, where: int) -> tuple[Any, dict[str, Any]]:
    if isinstance(row, str) or (isinstance(row, list) and all(isinstance(m, dict) for m in row)):
        return row, {}
    if isinstance(row, Mapping):
        if column not in row:
            raise ConfigError(
                f"dataset row {where} has no {column!r} column (columns: {sorted(row)}); set "
                "dataset.prompt_column"
            )
        prompt = row[column]
        if not (isinstance(prompt, str) or isinstance(prompt, list)):
            raise ConfigError(
                f"dataset row {where}: {column!r} must be a string or a list of chat messages, "
                f"not {type(prompt).__name__}"
            )
        return prompt, {k: v for k, v in row.items() if k != column}
    raise ConfigError(
        f"dataset row {where}: expected a string, a list of messages or a dict, "
        f"got {type(row).__name__}"
    )


class PromptDataset:
    """Prompts in a deterministic, resumable order over epochs.

    ``iter_from(position)`` yields ``Prompt``s from a global position (counting across epochs);
    the position to checkpoint is the rollout client's watermark (every prompt below it has been
    pushed as samples).
    """

    def __init__(
        self,
        rows: Sequence[Any],
        *,
        tokenizer: Any,
        prompt_column: str = "prompt",
        epochs: int | None = 1,
        shuffle: bool = True,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if not rows:
            raise ConfigError("the dataset has no rows")
        self._rows = [_normalise(row, prompt_column, i) for i, row in enumerate(rows)]
        self.tokenizer = tokenizer
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self.skipped_too_long = 0
        self._perm_cache: tuple[int, list[int]] | None = None

    @classmethod
    def from_config(
        cls, config: DatasetConfig, *, tokenizer: Any, holdout: float | None = None
    ) -> PromptDataset:
        """The training prompts; ``holdout``: less the share :func:`split_rows` keeps out."""
        rows = _read_rows(config)
        if holdout is not None:
            rows, _ = split_rows(rows, holdout, seed=config.seed)
        return cls(
            rows,
            tokenizer=tokenizer,
            prompt_column=config.prompt_column,
            epochs=config.epochs,
            shuffle=config.shuffle,
            seed=config.seed,
            max_prompt_tokens=config.max_prompt_tokens,
        )

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self._rows)

    @property
    def total(self) -> int | None:
        """Positions over all epochs; None when repeating forever."""
        return None if self.epochs is None else self.epochs * len(self._rows)

    def order(self, epoch: int) -> list[int]:
        """Row indices of one epoch: a permutation seeded by (seed, epoch), or identity."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        perm = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(f"asyncgrpo:{self.seed}:{epoch}").shuffle(perm)
        self._perm_cache = (epoch, perm)
        return perm

    def at(self, position: int) -> Prompt:
        """The prompt at a global position (tokenized)."""
        n = len(self._rows)
        epoch, offset = divmod(position, n)
        prompt, extra = self._rows[self.order(epoch)[offset]]
        return Prompt(
            index=position,
            epoch=epoch,
            prompt=prompt,
            prompt_ids=encode_prompt(self.tokenizer, prompt),
            extra=extra,
        )

    def iter_from(self, position: int = 0) -> Iterator[Prompt]:
        """Prompts from ``position`` to the end of the last epoch (or forever)."""
        if position < 0:
            raise ValueError(f"position {position} < 0")
        total = self.total
        while total is None or position < total:
            item = self.at(position)
            position += 1
            if self.max_prompt_tokens is not None and len(item.prompt_ids) > self.max_prompt_tokens:
                self.skipped_too_long += 1
                logger.warning(
                    "skipping prompt at position %d: %d tokens > dataset.max_prompt_tokens=%d",
                    item.index,
                    len(item.prompt_ids),
                    self.max_prompt_tokens,
                )
                continue
            yield item
