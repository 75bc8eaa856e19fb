"""verifiers 0.4 (``verifiers.v1``) environments, their model turns answered token-exactly.

A v1 episode is verifiers' own machinery: ``Env.run_episode(task, ctx)`` starts the agent's
harness program, which calls the model through verifiers' interception server over HTTP, and
the task's tool servers over MCP; the task's ``@vf.reward`` methods score the trace. Every model
call reaches the interception server's ``Client`` (``get_response(dialect, body, ...)``). Here
that client is :class:`TurnClient`: the first turn is the conversation through the model's chat
template (with the tools), every later turn the previous turn's exact ids, the ids vLLM sampled
and only the new messages rendered once (:class:`~asyncgrpo.rollout.environment.ChatContinuation`),
sent through asyncgrpo's policy client to ``/v1/completions`` as token ids, under the current
adapter version. The episode trained on is that token record, not verifiers' re-rendering.

verifiers builds the interception server's client from the rollout's client config
(``resolve_client``); :func:`install` makes it return a registered :class:`TurnClient` for the
``asyncgrpo://`` addresses this module hands out, and verifiers' own client otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire

from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.rollout.chat_turns import ChatTurns, Seat, TurnRefused
from asyncgrpo.rollout.policy import Turn

__all__ = ["TurnClient", "install", "refusals"]

logger = logging.getLogger(__name__)

SCHEME = "asyncgrpo://"
_clients: dict[str, TurnClient] = {}


def install() -> None:
    """Route ``asyncgrpo://`` client configs to their :class:`TurnClient` (idempotent)."""
    from verifiers.v1.interception import server

    original = server.resolve_client
    if getattr(original, "asyncgrpo", False):
        return

    def resolve(config: Any) -> Any:
        url = str(getattr(config, "base_url", ""))
        if url.startswith(SCHEME):
            client = _clients.get(url)
            if client is None:
                raise ConfigError(f"{url}: no asyncgrpo turn client is registered there")
            return client
        return original(config)

    resolve.asyncgrpo = True  # type: ignore[attr-defined]
    server.resolve_client = resolve


@contextlib.contextmanager
def registered(client: TurnClient) -> Any:
    """``client`` reachable at its address while the block runs; the client config to use."""
    _clients[client.url] = client
    try:
        # a train config: the interception server then asks the client for whole responses
        # (and frames them as a stream itself) instead of relaying a provider's stream
        yield vf.TrainClientConfig(base_url=client.url, api_key_var="ASYNCGRPO_UNUSED")
    finally:
        _clients.pop(client.url, None)


def refusals(env: Any) -> list[str]:
    """What asyncgrpo cannot run in the loaded v1 environment ``env``, one line each: agent
    runtimes other than a local subprocess (sandboxes: prime, docker, modal, e2b, ...),
    harnesses that need a container, tool servers in a remote runtime (tunnels)."""
    from verifiers.v1.runtimes import runtime_is_local

    found = []
    for name, spec in env._agent_specs.items():
        kind = getattr(spec.runtime, "type", type(spec.runtime).__name__)
        if kind != "subprocess":
            found.append(
                f"agent {name!r} runs in a {kind!r} runtime (a sandbox): asyncgrpo runs "
                f"agents as local subprocesses only; set {name}.runtime.type: subprocess"
            )
        harness = env._harnesses[name]
        if harness.NEEDS_CONTAINER:
            found.append(
                f"agent {name!r}: harness {harness.config.id!r} needs a container (a "
                "sandbox), which asyncgrpo does not run; use the null or bash harness"
            )
    task_cls = type(env.taskset).task_type()
    servers = [
        *task_cls.toolsets(env.taskset.config.task),
        *env.taskset.toolsets(env.taskset.config),
    ]
    for server in servers:
        cfg = server.config
        if not getattr(cfg, "url", None) and not runtime_is_local(cfg.runtime):
            found.append(
                f"tool server {type(server).__name__} runs in a remote runtime, reachable only "
                "through a tunnel, which asyncgrpo does not open; give it a subprocess runtime"
            )
    return found


class TurnClient(vf.Client):
    """The model client of an environment's episodes: answers verifiers' model calls
    token-exactly, each agent run (trace) on the :class:`Seat` taken for it with
    :meth:`seat` when verifiers mints the trace. Sampling settings are the run's
    ``generation`` section (``max_tokens`` per turn), not the harness's.
    """

    def __init__(self, turns: ChatTurns) -> None:
        self.url = f"{SCHEME}{secrets.token_hex(8)}/v1"
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
            raise vf.ProviderError(f"no episode of asyncgrpo's plays trace {session_id!r}",
                                   status_code=400)  # fmt: skip
        try:
            return await self._answer(seat, dialect, body)
        except AsyncGRPOError as exc:
            seat.error = exc
            raise

    async def _answer(self, seat: Seat, dialect: Any, body: dict) -> Any:
        if not isinstance(dialect, ChatDialect):
            raise vf.ProviderError(
                f"the harness called the model with the {type(dialect).__name__}: asyncgrpo "
                "plays chat-completions harnesses only (null, bash)",
                status_code=400,
            )
        request = dialect.parse_request(body)
        messages = [message_to_wire(m) for m in request.messages]
        tools = [tool_to_wire(t) for t in request.tools] if request.tools else None
        try:
            got, calls = await self.turns.answer(seat, messages, tools)
        except TurnRefused as exc:
            raise vf.ProviderError(str(exc), status_code=exc.status) from exc
        return self._response(got, calls, seat.policy.model)

    @staticmethod
    def _response(got: Turn, calls: list[dict[str, Any]], model: str) -> Any:
        tool_calls = [
            vf.ToolCall(
                id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]
            )
            for c in calls
        ] or None
        finish = "length" if got.finish_reason == "length" else ("tool_calls" if calls else "stop")
        response = vf.Response(
            id=f"asyncgrpo-{secrets.token_hex(4)}", created=0, model=model,
            message=vf.AssistantMessage(content=got.text or None, tool_calls=tool_calls),
            finish_reason=finish,
            usage=vf.Usage(prompt_tokens=len(got.prompt_ids), completion_tokens=len(got.token_ids)),
            tokens=vf.TurnTokens(prompt_ids=got.prompt_ids, completion_ids=got.token_ids,
                                 completion_logprobs=got.logprobs),
        )  # fmt: skip
        response.raw = serialize_completion(response, model)
        return response


@contextlib.asynccontextmanager
async def serving(env: Any) -> AsyncIterator[None]:
    """verifiers' serving resources (interception server, shared tool servers) for a run."""
    install()
    async with env.serving():
        yield
