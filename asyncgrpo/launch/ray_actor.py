"""What runs on a Ray node for ``--backend ray``: one actor per role, owning its process group.

:class:`RoleActor` is plain Python; the backend (:mod:`.ray_jobs`) makes it a Ray actor with
the role's resources. It starts the role's command (``python -m asyncgrpo.serve``, ``python -m
asyncgrpo.run.job``) with :func:`~asyncgrpo.processes.start_group` on the actor's event loop
thread, so the process group gets SIGTERM when the actor's process dies however it dies
(``ray.kill``, its node's OOM killer, the launcher's end taking its actors with it), and stops
its own vLLM engine; Ray's SIGKILL of an actor's children, which would pre-empt that, is turned
off in the actor's ``runtime_env`` (:data:`~asyncgrpo.launch.ray_jobs.ROLE_RUNTIME_ENV`). The command names the node's address and a port free there as
:data:`NODE_IP` and :data:`PORT`, and its Python as ``python``: only the node knows them.

The role's output goes to a file in its working directory on the node, not to the actor's
stdout, so Ray's log forwarding carries none of it; the launcher reads it through
:meth:`RoleActor.read`. The environment and secrets come as an argument of
:meth:`RoleActor.start`, never in the command; not in a ``runtime_env`` either, whose
``env_vars`` Ray writes to its ``runtime_env_agent.log`` and shows in its state API
(``serialized_runtime_env``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from asyncgrpo.processes import free_port, log_tail, start_group, stop_group

__all__ = ["NODE_IP", "PORT", "RoleActor", "current_node_id", "node_address", "node_argv"]

#: Stands in a command for the address of the node the actor runs on.
NODE_IP = "<node-ip>"
#: Stands in a command for a TCP port free on that node.
PORT = "<port>"
#: Stands first in a command for the Python the actor runs (the node's).
PYTHON = "python"
#: The most bytes of log one :meth:`RoleActor.read` returns.
READ_MAX = 1 << 20
LOG_NAME = "job.log"


def node_argv(argv: list[str], *, node_ip: str, port: int | None, python: str) -> list[str]:
    """``argv`` with :data:`NODE_IP` and :data:`PORT` filled in, a leading ``python`` the
    node's."""
    out = [a.replace(NODE_IP, node_ip).replace(PORT, str(port)) for a in argv]
    if out and out[0] == PYTHON:
        out[0] = python
    return out


def current_node_id() -> str:
    """The Ray node this process runs on (an actor's, or the driver's)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def node_address(node_id: str) -> str:
    """The address node ``node_id`` registered with the cluster (``ray start
    --node-ip-address``), the one the other nodes reach it at."""
    import ray

    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


class RoleActor:
    """One role's process group on a Ray node (an async actor: every method runs on the
    actor's event loop thread, the one that must start the process)."""

    def __init__(self) -> None:
        self._process: Process | None = None
        self._log: Path | None = None

    async def start(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        workdir: str,
        launcher_ip: str | None,
        fallback: str,
    ) -> dict[str, Any]:
        """Start ``argv`` with ``env`` added to the actor's environment, in ``workdir`` (the
        launcher's own directory when this node is on the launcher's host; else
        ``<tmp>/asyncgrpo/<fallback>``); where it runs."""
        node_id = current_node_id()
        node_ip = node_address(node_id)
        port = free_port(node_ip) if any(PORT in a for a in argv) else None
        if node_ip != launcher_ip:
            workdir = str(Path(tempfile.gettempdir()) / "asyncgrpo" / fallback)
        cwd = Path(workdir)
        cwd.mkdir(parents=True, exist_ok=True)
        self._log = cwd / LOG_NAME
        command = node_argv(argv, node_ip=node_ip, port=port, python=sys.executable)
        with self._log.open("ab") as out:
            self._process = await start_group(
                command, stdout=out, stderr=out, cwd=cwd, env={**os.environ, **env}
            )
        return {
            "node_ip": node_ip,
            "port": port,
            "node_id": node_id,
            "pid": self._process.pid,
            "workdir": str(cwd),
        }

    async def returncode(self) -> int | None:
        """None while the process runs; its exit status once it ended."""
        assert self._process is not None
        return self._process.returncode

    async def read(self, offset: int) -> tuple[bytes, bool]:
        """The log from byte ``offset`` (at most :data:`READ_MAX`), and whether the process had
        ended before it was read (then nothing more will come after it)."""
        assert self._process is not None and self._log is not None
        ended = self._process.returncode is not None
        async with await anyio.open_file(self._log, "rb") as f:
            await f.seek(offset)
            chunk = await f.read(READ_MAX)
        return chunk, ended and len(chunk) < READ_MAX

    async def tail(self, lines: int) -> str:
        return (
            "" if self._log is None else await anyio.to_thread.run_sync(log_tail, self._log, lines)
        )

    async def stop(self, grace_s: float, what: str) -> None:
        """SIGTERM the process group; SIGKILL what is left after ``grace_s``."""
        if self._process is not None:
            with anyio.CancelScope(shield=True):
                await stop_group(self._process, grace_s, what)
