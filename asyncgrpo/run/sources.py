"""Where a run's samples come from: a rollout client in the trainer's process, or rollout
processes on other machines through the transport's channel.

The training loop sees only :class:`SampleSource`; :func:`rollout_client` builds the client both
the trainer's own source and a remote rollout process (:mod:`asyncgrpo.run.rollouts`) use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import anyio

from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import PromptDataset, load_tokenizer
from asyncgrpo.rollout.window import AdmissionWindow
from asyncgrpo.sample import Sample
from asyncgrpo.store.channel import RolloutChannel

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.transport import Transport


class SampleSource(Protocol):
    """Scored samples for the training loop, and what a checkpoint needs to resume them."""

    async def take(self, n: int) -> list[Sample]:
        """Up to ``n`` samples; fewer only when the source has ended (empty: ended)."""
        ...

    def set_policy(self, name: str, version: int) -> None:
        """Generate new samples under adapter ``name`` (loaded on every replica)."""
        ...

    def position(self) -> int:
        """Where a resumed run continues (dataset position, or channel sequence)."""
        ...

    def skip(self) -> int:
        """Samples at :meth:`position` already taken (a channel batch taken in part)."""
        ...

    async def committed(self) -> None:
        """A checkpoint now covers everything taken so far."""
        ...

    def stats(self) -> dict[str, float]:
        """Metrics of the source since the last call."""
        ...

    def queue_size(self) -> int:
        """Samples ready to be taken."""
        ...


async def rollout_client(
    cfg: TrainingConfig,
    base_url: str,
    policy: tuple[str, int],
    position: int,
    *,
    api_key: str | None,
    window: AdmissionWindow | None = None,
    adapter_wait_s: float = 0.0,
) -> RolloutClient:
    """The rollout client of a run: the dataset with the model's chat template, via ``base_url``.

    ``window``: in the trainer's process, start no rollout the trainer would drop as stale (a
    remote client cannot see what the trainer has read, and relies on the queue bound).
    ``adapter_wait_s``: how long a request waits for an adapter no replica serves (a rollout
    process outliving its trainer's restart); 0: fail at once.
    """
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, cfg.model)
    return RolloutClient(
        base_url=base_url,
        dataset=PromptDataset.from_config(
            cfg.dataset, tokenizer=tokenizer, holdout=cfg.eval.holdout if cfg.eval else None
        ),
        generation=cfg.generation,
        rollout=cfg.rollout,
        policy=policy,
        start_position=position,
        api_key=api_key,
        window=window,
        adapter_wait_s=adapter_wait_s,
    )


class LocalSource:
    """Samples from a rollout client in this process; its position is the dataset's."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client

    async def take(self, n: int) -> list[Sample]:
        return await self.client.get(n)

    def set_policy(self, name: str, version: int) -> None:
        self.client.set_policy(name, version)

    def position(self) -> int:
        return self.client.position

    def skip(self) -> int:
        return 0

    async def committed(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return self.client.stats()

    def queue_size(self) -> int:
        return self.client.queue_size


def trainer_channel(transport: Transport, trainer: Any, cfg: TrainingConfig) -> RolloutChannel:
    """The trainer's end of the rollout channel: a batch is checked against the model it feeds
    (vocabulary, context, non-empty prompt and completion) and quarantined if it fails, so
    that no batch from storage can stop the trainer at every resume."""
    bounds = trainer.sample_bounds(cfg.serve.max_model_len)
    return RolloutChannel(transport, check=bounds.check)


class ChannelSource:
    """Samples shipped by remote rollout processes; the policy travels as ``policy.json``
    (:class:`~asyncgrpo.store.run_documents.RunStore`), which the trainer writes and they poll.

    A step takes ``samples_per_step`` samples, which need not be whole batches (stale samples
    are dropped on the way), so where a checkpoint resumes is a batch and how many of its
    samples were taken (:meth:`position`, :meth:`skip`): a restarted trainer takes each sample
    after the last one it took, none twice. ``skip``: samples of the first batch received that
    a checkpoint says were taken before it.
    """

    def __init__(self, channel: RolloutChannel, *, skip: int = 0) -> None:
        self.channel = channel
        self.buffer: list[Sample] = []
        self._batch: int | None = None  #: the batch the buffer's samples come from
        self._taken = 0  #: samples of that batch taken
        self._skip = skip

    async def take(self, n: int) -> list[Sample]:
        while not self.buffer:
            batch = await self.channel.receive()
            skip, self._skip = self._skip, 0
            self.buffer = list(batch.samples[skip:])
            self._batch, self._taken = batch.seq, min(skip, len(batch.samples))
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        self._taken += len(out)
        return out

    def set_policy(self, name: str, version: int) -> None:
        pass  # the trainer writes policy.json; rollout processes poll it

    def position(self) -> int:
        """The first batch with a sample not taken (the one after the last batch taken whole)."""
        if self._batch is None:
            return self.channel.position or 0
        return self._batch if self.buffer else self._batch + 1

    def skip(self) -> int:
        return self._taken if self.buffer else 0

    async def committed(self) -> None:
        """Commit the channel's cursor, unless the last batch is only partly taken: the cursor
        then stays on it (a compacting channel drops what the cursor passed)."""
        if not self.buffer:
            await self.channel.commit()

    def stats(self) -> dict[str, float]:
        return {"rollout/quarantined_batches": float(self.channel.quarantined)}

    def queue_size(self) -> int:
        return len(self.buffer)
