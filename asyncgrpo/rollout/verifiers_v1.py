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
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire

from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.rollout.dataset import encode_prompt
from asyncgrpo.rollout.environment import ChatContinuation, Message, Trajectory
from asyncgrpo.rollout.policy import PolicyClient, Turn
from asyncgrpo.rollout.verifiers_env import parse_tool_calls

__all__ = ["Seat", "TurnClient", "install", "refusals"]

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


class Seat:
    """One agent run's part in an episode (verifiers' trace id is its session): who samples
    its turns, under which ``X-Session-ID`` and seeds, and its token record."""

    def __init__(
        self, policy: PolicyClient, session: str | None, seed: Callable[[int], int | None]
    ) -> None:
        self.policy, self.session, self.seed = policy, session, seed
        self.traj: Trajectory | None = None
        self.prompt_messages = 0
        self.tools: Any = None  # what the first turn offered (OpenAI's function form)
        self.sent: list[Message] = []  # the conversation of the last turn, with its answer
        self.last: Turn | None = None
        #: an error of asyncgrpo's side (a replica failure): verifiers would turn it into an
        #: episode error; the environment re-raises it so that it stops the run
        self.error: AsyncGRPOError | None = None


class TurnClient(vf.Client):
    """The model client of an environment's episodes: answers verifiers' model calls
    token-exactly, each agent run (trace) on the :class:`Seat` taken for it with
    :meth:`seat` when verifiers mints the trace. Sampling settings are the run's
    ``generation`` section (``max_tokens`` per turn), not the harness's.
    """

    def __init__(self, *, tokenizer: Any, max_tokens: int, max_episode_tokens: int) -> None:
        self.url = f"{SCHEME}{secrets.token_hex(8)}/v1"
        self.tokenizer, self.max_tokens, self.max_episode_tokens = (
            tokenizer, max_tokens, max_episode_tokens,
        )  # fmt: skip
        self.chat = ChatContinuation(tokenizer)
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
        if any(isinstance(m.get("content"), list) for m in messages):
            raise vf.ProviderError(
                "a message has content parts (multimodal): asyncgrpo plays text", status_code=400
            )
        tools = [tool_to_wire(t) for t in request.tools] if request.tools else None
        traj = self._extend(seat, messages, tools)
        room = min(self.max_tokens, self.max_episode_tokens - len(traj.ids))
        if room < 1:
            raise vf.ProviderError(
                f"the episode reached max_episode_tokens={self.max_episode_tokens}", status_code=400
            )
        turns = await seat.policy.complete(
            traj.ids, seed=seat.seed(traj.model_turns), max_tokens=room, session=seat.session
        )
        if not turns:
            raise vf.ProviderError(
                "a model turn came back without usable logprobs", status_code=502
            )
        got = seat.last = turns[0]
        traj.add_turn(got)
        calls = parse_tool_calls(got.text) if tools else []
        answer: Message = {"role": "assistant", "content": got.text}
        if calls:
            answer["tool_calls"] = calls
        seat.sent = [*messages, answer]
        return self._response(got, calls, seat.policy.model)

    def _extend(self, seat: Seat, messages: list[Message], tools: Any) -> Trajectory:
        """The ids to send: the first turn's prompt, or the last turn's sequence plus the new
        messages rendered once."""
        if seat.traj is None:
            seat.traj = Trajectory(self._prompt_ids(messages, tools))
            seat.prompt_messages, seat.tools = len(messages), tools
            return seat.traj
        n = len(seat.sent)
        if _said(messages[:n]) != _said(seat.sent) or seat.last is None:
            raise vf.ProviderError(
                "the harness changed earlier messages of an episode between turns; its turns "
                "cannot be continued token-exactly",
                status_code=400,
            )
        seat.traj.add_env(self.chat.ids(messages[n:], after=seat.last))
        return seat.traj

    def _prompt_ids(self, messages: list[Message], tools: Any) -> list[int]:
        if not tools:
            return encode_prompt(self.tokenizer, messages)
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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


def _said(messages: list[Message]) -> list[tuple[Any, str]]:
    """Who said what: how two renderings of a conversation are compared."""
    return [(m.get("role"), str(m.get("content") or "")) for m in messages]


@contextlib.asynccontextmanager
async def serving(env: Any) -> AsyncIterator[None]:
    """verifiers' serving resources (interception server, shared tool servers) for a run."""
    install()
    async with env.serving():
        yield
