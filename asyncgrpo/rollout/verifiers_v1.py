"""verifiers 0.4 (``verifiers.v1``) model calls answered token-exactly, in process.

A v1 episode is verifiers' own machinery: ``Env.run_episode(task, ctx)`` starts the agent's
harness program, which calls the model through verifiers' interception server over HTTP, and
the task's tool servers over MCP; the task's ``@vf.reward`` methods score the trace. Every model
call reaches the interception server's ``Client`` (``get_response(dialect, body, ...)``). Here
that client is :class:`TurnClient`, which answers each call with
:class:`~asyncgrpo.rollout.chat_turns.ChatTurns` (token ids from vLLM through asyncgrpo's
policy client, under the current adapter version) on the :class:`~asyncgrpo.rollout.chat_turns.Seat`
of the agent run (verifiers' trace id). The episode trained on is that seat's token record.
verifiers builds the interception server's client from the rollout's client config;
:func:`~asyncgrpo.rollout.vf_worker.install` makes it return the registered client.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import verifiers.v1 as vf

from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.rollout.chat_turns import ChatTurns, Seat, TurnRefused
from asyncgrpo.rollout.vf_worker import chat_request, install, response

__all__ = ["TurnClient", "serving"]


class TurnClient(vf.Client):
    """The model client of an environment's episodes: each agent run (trace) is answered on
    the :class:`Seat` taken for it with :meth:`seat` when verifiers mints the trace. Sampling
    settings are the run's ``generation`` section, not the harness's."""

    def __init__(self, turns: ChatTurns) -> None:
        self.turns = turns
        self.seats: dict[str, Seat] = {}

    def seat(self, trace_id: str, seat: Seat) -> None:
        self.seats[trace_id] = seat

    def release(self, trace_ids: list[str]) -> dict[str, Seat]:
        """The seats of ``trace_ids``, no longer answered for."""
        return {t: s for t in trace_ids if (s := self.seats.pop(t, None)) is not None}

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        seat = self.seats.get(session_id or "")
        if seat is None:
            raise vf.ProviderError(
                f"no episode of asyncgrpo's plays trace {session_id!r}", status_code=400
            )
        messages, tools = chat_request(dialect, body)
        try:
            got, calls = await self.turns.answer(seat, messages, tools)
        except TurnRefused as exc:
            raise vf.ProviderError(str(exc), status_code=exc.status) from exc
        except AsyncGRPOError as exc:
            seat.error = exc
            raise
        answer = {"text": got.text, "prompt_ids": got.prompt_ids, "completion_ids": got.token_ids,
                  "logprobs": got.logprobs, "finish_reason": got.finish_reason,
                  "tool_calls": calls}  # fmt: skip
        return response(answer, seat.policy.model)


@contextlib.asynccontextmanager
async def serving(env: Any) -> AsyncIterator[None]:
    """verifiers' serving resources (interception server, shared tool servers) for a run."""
    install()
    async with env.serving():
        yield
