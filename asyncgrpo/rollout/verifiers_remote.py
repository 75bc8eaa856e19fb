"""A verifiers 0.4 environment run in a process (and venv) of its own.

``rollout.environment: {verifiers: NAME, args: {...}, python: PATH}``: PATH is the Python of a
venv that holds verifiers 0.4 and the environment's package, whatever they pin; the trainer's
venv needs neither. That Python runs ``asyncgrpo/rollout/vf_worker.py`` by path (it imports
only verifiers), which plays the episodes with verifiers' own machinery and forwards every
model call here over its stdin/stdout (JSON lines; the protocol is in that module's
docstring). Here each call is answered token-exactly by
:class:`~asyncgrpo.rollout.chat_turns.ChatTurns` through asyncgrpo's policy client, and the
episode trained on is this side's token record, scored by the rewards the environment reports.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import AsyncGRPOError, ConfigError, LaunchError, leaves
from asyncgrpo.processes import start_group, stop_group
from asyncgrpo.rollout.chat_turns import ChatTurns, PlayedEnv, Seat, TurnRefused, episode_of
from asyncgrpo.rollout.dataset import Prompt
from asyncgrpo.rollout.environment import Episode
from asyncgrpo.rollout.policy import PolicyClient

__all__ = ["WORKER", "RemoteV1Env"]

logger = logging.getLogger(__name__)

#: The environment process's program, run by path with the environment's Python.
WORKER = Path(__file__).with_name("vf_worker.py")


class _Episode:
    """One episode in flight: its seats by trace id, and its outcome once done."""

    def __init__(self, policy: PolicyClient, session: str | None, seed: Any) -> None:
        self.policy, self.session, self.seed = policy, session, seed
        self.seats: dict[str, Seat] = {}
        self.done = anyio.Event()
        self.result: dict[str, Any] = {}


class RemoteV1Env(PlayedEnv):
    """A verifiers 0.4 environment in its own process; see the module docstring.

    ``python``: the environment venv's interpreter. ``max_episode_tokens`` and
    ``episode_timeout_s`` as for :class:`~asyncgrpo.rollout.verifiers_v1_env.VerifiersV1Env`;
    ``start_timeout_s`` bounds loading the environment there.
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        generation: GenerationConfig,
        name: str,
        python: str,
        args: Mapping[str, Any] | None = None,
        max_episode_tokens: int = 1024,
        episode_timeout_s: float = 120.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(tokenizer=tokenizer, generation=generation)
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ConfigError(
                f"rollout.environment.python={python!r} is not an executable file: give the "
                "Python of the venv that holds verifiers 0.4 and the environment's package"
            )
        if max_episode_tokens < 2 or episode_timeout_s <= 0:
            raise ConfigError(
                f"RemoteV1Env: max_episode_tokens={max_episode_tokens} must be >= 2 and "
                f"episode_timeout_s={episode_timeout_s} > 0"
            )
        self.name, self.python, self.args = name, python, dict(args or {})
        self.episode_timeout_s, self.start_timeout_s = episode_timeout_s, start_timeout_s
        self.turns = ChatTurns(
            tokenizer=tokenizer,
            max_tokens=generation.max_completion_length,
            max_episode_tokens=max_episode_tokens,
        )
        self.fields: list[str] = []
        self._process: anyio.abc.Process | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._episodes: dict[int, _Episode] = {}
        self._by_trace: dict[str, _Episode] = {}
        self._ids = itertools.count()
        self._send_lock = anyio.Lock()
        self._gone = ""  # why the environment process is no more

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The environment process, loaded and serving, for as long as the block runs."""
        # its venv's bin first: verifiers finds uv (its harness programs' runner) there
        path = os.pathsep.join([os.path.dirname(self.python), os.environ.get("PATH", "")])
        process = await start_group(
            [self.python, str(WORKER)],
            stdin=-1,
            stdout=-1,
            stderr=None,
            env={**os.environ, "PATH": path},
        )
        self._process = process
        try:
            await self._send({"op": "load", "name": self.name, "args": self.args})
            lines = _lines(process)
            try:
                with anyio.fail_after(self.start_timeout_s):
                    first = await anext(lines, {"op": "error", "message": "the process exited"})
            except TimeoutError as exc:
                raise ConfigError(
                    f"verifiers environment {self.name!r} did not load within "
                    f"start_timeout_s={self.start_timeout_s:g}"
                ) from exc
            if first["op"] != "ready":
                raise ConfigError(f"verifiers environment {self.name!r}: {first.get('message')}")
            self.fields = list(first["fields"])
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    tg.start_soon(self._read, lines)
                    yield
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:  # what the block raised, as it raised it
                inner = leaves(group)
                if len(inner) == 1 and isinstance(inner[0], Exception):
                    raise inner[0] from None
                raise
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await stop_group(process, 10, f"verifiers environment {self.name!r}")

    async def _send(self, msg: dict[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        async with self._send_lock:
            await self._process.stdin.send((json.dumps(msg) + "\n").encode())

    async def _read(self, lines: AsyncIterator[dict[str, Any]]) -> None:
        async for msg in lines:
            op = msg.get("op")
            if op == "seat" and (ep := self._episodes.get(msg["episode"])):
                ep.seats[msg["trace"]] = Seat(ep.policy, ep.session, ep.seed)
                self._by_trace[msg["trace"]] = ep
            elif op == "call":
                assert self._tg is not None
                self._tg.start_soon(self._answer, msg)
            elif op == "done" and (ep := self._episodes.get(msg["id"])):
                ep.result = msg
                ep.done.set()
        assert self._process is not None
        self._gone = f"the environment process exited (status {await self._process.wait()})"
        for ep in self._episodes.values():  # every episode in flight went with it
            ep.result = {"error": self._gone, "traces": []}
            ep.done.set()

    async def _answer(self, msg: dict[str, Any]) -> None:
        ep = self._by_trace.get(msg.get("trace") or "")
        seat = ep.seats.get(msg["trace"]) if ep else None
        reply: dict[str, Any] = {"op": "answer", "id": msg["id"]}
        if seat is None:
            reply.update(error=f"no episode plays trace {msg.get('trace')!r}", status=400)
        else:
            try:
                got, calls = await self.turns.answer(seat, msg["messages"], msg.get("tools"))
                reply.update(
                    text=got.text,
                    prompt_ids=got.prompt_ids,
                    completion_ids=got.token_ids,
                    logprobs=got.logprobs,
                    finish_reason=got.finish_reason,
                    tool_calls=calls,
                )
            except TurnRefused as exc:
                reply.update(error=str(exc), status=exc.status)
            except AsyncGRPOError as exc:  # the replicas': raised after the episode
                seat.error = exc
                reply.update(error=str(exc), status=502)
        await self._send(reply)

    async def _play(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | str:
        if self._tg is None:
            raise RuntimeError("RemoteV1Env plays episodes inside `async with env.running()`")
        if self._gone:  # not one group's loss: no later episode can run either
            raise LaunchError(f"verifiers environment {self.name!r}: {self._gone}")
        eid = next(self._ids)
        seed = lambda turn: self.seed(task, index, turn)  # noqa: E731
        ep = self._episodes[eid] = _Episode(policy, self.session(task), seed)
        try:
            await self._send({"op": "episode", "id": eid, "row": self._row(task)})
            with anyio.move_on_after(self.episode_timeout_s) as scope:
                await ep.done.wait()
            if scope.cancelled_caught:
                await self._send({"op": "cancel", "id": eid})
                return f"an episode ran past episode_timeout_s={self.episode_timeout_s:g}"
        finally:
            self._episodes.pop(eid, None)
            for trace in ep.seats:
                self._by_trace.pop(trace, None)
        for seat in ep.seats.values():
            if seat.error is not None:
                raise seat.error  # the replicas', not the environment's: it stops the run
        return episode_of(ep.result, ep.seats)

    def _row(self, task: Prompt) -> dict[str, Any]:
        """The run's dataset row as the taskset's ``TaskData`` fields."""
        prompt = task.prompt if task.is_chat else [{"role": "user", "content": task.prompt}]
        row = {k: v for k, v in task.extra.items() if k in self.fields}
        return {**row, "prompt": prompt, "idx": task.index}


async def _lines(process: anyio.abc.Process) -> AsyncIterator[dict[str, Any]]:
    """The process's stdout as JSON objects, one per line, until it closes."""
    assert process.stdout is not None
    buffer = b""
    async for chunk in process.stdout:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield json.loads(line)
