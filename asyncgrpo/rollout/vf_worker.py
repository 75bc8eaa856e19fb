"""verifiers 0.4's side of a v1 environment: loading, refusals, the client seam, and the
environment process that runs in a venv of its own.

This module imports only the standard library and verifiers, never asyncgrpo, so that a venv
holding verifiers 0.4 (and whatever the environment's package pins) can run it by path:
``PYTHON .../asyncgrpo/rollout/vf_worker.py``. The process speaks JSON lines, one object per
line with an ``op``, over its stdin (from the trainer) and stdout (to it):

* in ``{"op": "load", "name": ..., "args": {...}}``; out ``{"op": "ready", "fields": [...]}``
  (the taskset's ``TaskData`` fields) or ``{"op": "error", "message": ...}``, then it exits;
* in ``{"op": "episode", "id": E, "row": {...}}``: play one episode of that task row; out
  ``{"op": "seat", "episode": E, "trace": T}`` as verifiers mints each agent run's trace,
  ``{"op": "call", "id": C, "trace": T, "messages": [...], "tools": [...] | null}`` for each
  model call, answered by in ``{"op": "answer", "id": C, "text", "prompt_ids",
  "completion_ids", "logprobs", "finish_reason", "tool_calls"}`` or ``{"op": "answer", "id":
  C, "error": ..., "status": N}``, and at the end ``{"op": "done", "id": E, "error": null |
  "...", "traces": [{"id": T, "rewards": {...}}]}``;
* in ``{"op": "cancel", "id": E}``: stop that episode (its ``done`` carries the error).

It also holds :class:`ChatHarness`, harness id ``asyncgrpo-chat``: verifiers' null harness (the
same chat program, MCP tools included) run in this process instead of one process per episode.

The trainer side (:mod:`asyncgrpo.rollout.verifiers_remote`) renders and samples every turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import secrets
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

__all__ = ["ChatHarness", "install", "load", "outcome", "refusals", "registered", "response"]

#: The harness id of :class:`ChatHarness` (verifiers imports it as the module ``asyncgrpo_chat``).
CHAT_HARNESS_ID = "asyncgrpo-chat"

SCHEME = "asyncgrpo://"
_clients: dict[str, Any] = {}


def install() -> None:
    """Route ``asyncgrpo://`` client configs to their registered client (idempotent)."""
    from verifiers.v1.interception import server

    original = server.resolve_client
    if getattr(original, "asyncgrpo", False):
        return

    def resolve(config: Any) -> Any:
        url = str(getattr(config, "base_url", ""))
        if url.startswith(SCHEME):
            client = _clients.get(url)
            if client is None:
                raise ValueError(f"{url}: no asyncgrpo turn client is registered there")
            return client
        return original(config)

    resolve.asyncgrpo = True  # type: ignore[attr-defined]
    server.resolve_client = resolve


@contextlib.contextmanager
def registered(client: Any) -> Iterator[Any]:
    """``client`` reachable at a fresh address while the block runs; the client config."""
    url = f"{SCHEME}{secrets.token_hex(8)}/v1"
    _clients[url] = client
    try:
        # a train config: the interception server then asks the client for whole responses
        # (and frames them as a stream itself) instead of relaying a provider's stream
        yield vf.TrainClientConfig(base_url=url, api_key_var="ASYNCGRPO_UNUSED")
    finally:
        _clients.pop(url, None)


def load(name: str, args: dict[str, Any] | None) -> Any:
    """The v1 environment of taskset ``name`` with the rest of the ``[env]`` block ``args``."""
    # verifiers resolves a harness id by importing the module of that name
    sys.modules.setdefault(CHAT_HARNESS_ID.replace("-", "_"), sys.modules[__name__])
    data = dict(args or {})
    taskset = {**dict(data.pop("taskset", None) or {}), "id": name}
    return vf.load_environment(vf.resolve_env_config({**data, "taskset": taskset}))


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
                "sandbox), which asyncgrpo does not run; use asyncgrpo-chat, null or bash"
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


def chat_request(dialect: Any, body: dict) -> tuple[list[dict], list[dict] | None]:
    """A model call's messages and tools, in OpenAI's wire form."""
    if not isinstance(dialect, ChatDialect):
        raise vf.ProviderError(
            f"the harness called the model with the {type(dialect).__name__}: asyncgrpo "
            "plays chat-completions harnesses only (null, bash)",
            status_code=400,
        )
    request = dialect.parse_request(body)
    tools = [tool_to_wire(t) for t in request.tools] if request.tools else None
    return [message_to_wire(m) for m in request.messages], tools


def response(answer: dict[str, Any], model: str) -> Any:
    """verifiers' ``Response`` for a sampled turn: ``text``, ``prompt_ids``,
    ``completion_ids``, ``logprobs``, ``finish_reason``, ``tool_calls`` (OpenAI's form)."""
    calls = answer.get("tool_calls") or []
    tool_calls = [
        vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in calls
    ] or None
    length = answer.get("finish_reason") == "length"
    prompt_ids, completion_ids = answer["prompt_ids"], answer["completion_ids"]
    made = vf.Response(
        id=f"asyncgrpo-{secrets.token_hex(4)}",
        created=0,
        model=model,
        message=vf.AssistantMessage(content=answer.get("text") or None, tool_calls=tool_calls),
        finish_reason="length" if length else ("tool_calls" if calls else "stop"),
        usage=vf.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(completion_ids)),
        tokens=vf.TurnTokens(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            completion_logprobs=answer["logprobs"],
        ),
    )
    made.raw = serialize_completion(made, model)
    return made


def outcome(played: Any) -> dict[str, Any]:
    """A finished episode as plain data: the last error (or None) and each trace's rewards."""
    errors = [*played.errors, *(e for t in played.traces for e in t.errors)]
    error = None
    if errors:
        error = f"{errors[-1].type}: {errors[-1].message}"
    elif not played.ok:
        error = "the episode did not finish"
    traces = [
        {"id": t.id, "rewards": {k: r.value for k, r in t.rewards.items() if r is not None}}
        for t in played.traces
    ]
    return {"error": error, "traces": traces}


# ---------------------------------------------------------------- the in-process chat harness


@functools.cache
def _chat_program() -> Any:
    """verifiers' bundled chat program (the null harness's, with its MCP client), compiled."""
    return compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec")


async def run_chat_program(argv: list[str], workdir: Path | None) -> vf.ProgramResult:
    """The null harness's program on ``argv``, run in this process: its own module namespace
    (fresh per run, so concurrent episodes share nothing), its exit as a ``ProgramResult``."""
    files = [a.split("=", 1) for a in argv if a.startswith("--initial-messages-file=")]
    if files and workdir is not None:  # written into the runtime's folder, the program's cwd
        argv = [a for a in argv if not a.startswith("--initial-messages-file=")]
        argv.append(f"--initial-messages-file={workdir / files[-1][1]}")

    class Parser(argparse.ArgumentParser):  # the program parses sys.argv; give it ours
        def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
            return super().parse_args(argv if args is None else args, namespace)

    ns: dict[str, Any] = {"__name__": "asyncgrpo_chat_program"}
    exec(_chat_program(), ns)  # verifiers' own program text, as its harness runs it
    ns["argparse"] = argparse.Namespace(ArgumentParser=Parser, Namespace=argparse.Namespace)
    clients: list[Any] = []
    make_client = ns["AsyncOpenAI"]

    def client(*args: Any, **kwargs: Any) -> Any:  # closed below, as a process exit would
        clients.append(made := make_client(*args, **kwargs))
        return made

    ns["AsyncOpenAI"] = client
    err = io.StringIO()
    try:
        await ns["main"]()
        code = 0
    except SystemExit as exc:  # the program's own exit codes (97: the model connection)
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        err.write(traceback.format_exc())
        code = 1
    finally:
        for made in clients:
            await made.close()
    return vf.ProgramResult(exit_code=code, stdout="", stderr=err.getvalue())


class _HereRuntime:
    """The rollout's runtime, except that the chat program runs in this process."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: Any, env: Any = None, **_: Any) -> list[str]:
        return ["asyncgrpo-chat"]

    async def run_program(self, argv: list[str], env: dict[str, str]) -> vf.ProgramResult:
        return await run_chat_program(argv[1:], getattr(self._runtime, "workdir", None))


class ChatHarness(NullHarness):
    """verifiers' null harness (a chat loop calling the task's MCP tools) played in this
    process: the same program text, run here instead of as a uv script per episode, whose
    start (a Python importing openai and mcp) is most of a local episode's time. Local
    (subprocess) runtimes only, as for every environment asyncgrpo plays; the harness's
    ``env`` settings have no process to apply to (the chat loop reads none)."""

    async def setup(self, runtime: Any) -> None:
        """Nothing to install: the program runs on this process's packages."""

    async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kwargs: Any) -> Any:
        return await super().launch(ctx, trace, _HereRuntime(runtime), *args, **kwargs)


# ---------------------------------------------------------------- the environment process


class _PipeClient(vf.Client):
    """Forwards each model call to the trainer and waits for its answer."""

    def __init__(self, send: Callable[[dict], None]) -> None:
        self.send = send
        self.waiting: dict[int, asyncio.Future] = {}
        self.calls = 0

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Any = None,
    ) -> Any:
        messages, tools = chat_request(dialect, body)
        self.calls += 1
        call = self.calls
        future = self.waiting[call] = asyncio.get_running_loop().create_future()
        self.send(
            {"op": "call", "id": call, "trace": session_id, "messages": messages, "tools": tools}
        )
        try:
            answer = await future
        finally:
            self.waiting.pop(call, None)
        if answer.get("error"):
            raise vf.ProviderError(answer["error"], status_code=answer.get("status", 502))
        return response(answer, body.get("model", ""))


async def _serve(env: Any, config: Any, client: _PipeClient, send: Callable[[dict], None]) -> None:
    """Episodes and answers from stdin until it closes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[int, asyncio.Task] = {}
    task_cls = type(env.taskset).task_type()

    async def episode(eid: int, row: dict[str, Any]) -> None:
        def seat(trace: Any) -> None:
            send({"op": "seat", "episode": eid, "trace": trace.id})

        try:
            task = task_cls(task_cls.data_type().model_validate(row), env.taskset.config.task)
            played = await env.run_episode(
                task, vf.ModelContext(model="policy", client=config), on_trace=seat
            )
            send({"op": "done", "id": eid, **outcome(played)})
        except asyncio.CancelledError:
            send({"op": "done", "id": eid, "error": "cancelled", "traces": []})
        except Exception as exc:  # the episode's failure is data for the trainer
            send({"op": "done", "id": eid, "error": f"{type(exc).__name__}: {exc}", "traces": []})
        finally:
            running.pop(eid, None)

    while line := await reader.readline():
        msg = json.loads(line)
        if msg["op"] == "episode":
            running[msg["id"]] = asyncio.create_task(episode(msg["id"], msg["row"]))
        elif msg["op"] == "answer" and (future := client.waiting.get(msg["id"])):
            future.set_result(msg)
        elif msg["op"] == "cancel" and (job := running.get(msg["id"])):
            job.cancel()
    for job in list(running.values()):
        job.cancel()


async def _main() -> None:
    out = sys.stdout

    def send(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    sys.stdout = sys.stderr  # verifiers' and the environment's prints must not reach the pipe
    first = json.loads(sys.stdin.readline())
    try:
        env = load(first["name"], first.get("args"))
        problems = refusals(env)
    except Exception as exc:
        send({"op": "error", "message": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
        return
    if problems:
        send({"op": "error", "message": problems[0]})
        return
    install()
    client = _PipeClient(send)
    with registered(client) as config:
        async with env.serving():
            fields = sorted(type(env.taskset).task_type().data_type().model_fields)
            send({"op": "ready", "fields": fields})
            await _serve(env, config, client, send)


if __name__ == "__main__":
    asyncio.run(_main())
