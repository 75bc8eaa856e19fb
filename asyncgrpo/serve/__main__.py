"""``python -m asyncgrpo.serve --model DIR --replicas N``: run local vLLM replicas until interrupted.

Prints one line per replica with its URL once every replica is healthy; SIGINT or SIGTERM stops
all of them (whole process trees).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import anyio

from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.serve.config import ServeConfig
from asyncgrpo.serve.replicas import launch_replicas


def parse_args(argv: Sequence[str] | None) -> ServeConfig:
    p = argparse.ArgumentParser(prog="python -m asyncgrpo.serve", description=__doc__)
    p.add_argument("--model", required=True, help="model directory or Hugging Face id")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="first port; default: free ports")
    p.add_argument("--lora-rank", type=int, default=8, help="largest adapter rank to serve")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=int, default=None, help="CPU KV cache, whole GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument(
        "--nice", type=int, default=0, help="lower priority (0-19) on hosts shared with a trainer"
    )
    p.add_argument(
        "--api-key-env",
        default=None,
        help="name of an env var holding the API key (keeps it out of argv)",
    )
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument(
        "--transport",
        action="append",
        default=[],
        metavar="URL",
        help="transport root the replicas may fetch adapter versions from (repeatable)",
    )
    p.add_argument("--adapter-cache-dir", default=None, help="where replicas cache adapters")
    p.add_argument(
        "extra_args", nargs=argparse.REMAINDER, help="after --: more vLLM flags, passed through"
    )
    a = p.parse_args(argv)
    import os

    extra = a.extra_args[1:] if a.extra_args[:1] == ["--"] else a.extra_args
    return ServeConfig(
        model=a.model, replicas=a.replicas, host=a.host, port=a.port, lora_rank=a.lora_rank,
        max_staleness=a.max_staleness, max_loras=a.max_loras, dtype=a.dtype,
        max_model_len=a.max_model_len, kv_cache_gib=a.kv_cache_gib,
        gpu_memory_utilization=a.gpu_memory_utilization, nice=a.nice,
        api_key=os.environ.get(a.api_key_env) if a.api_key_env else None,
        startup_timeout_s=a.startup_timeout_s, log_dir=a.log_dir, extra_args=extra,
        transports=tuple(a.transport), adapter_cache_dir=a.adapter_cache_dir,
    )  # fmt: skip


async def _serve(config: ServeConfig) -> None:
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        async with launch_replicas(config) as replicas:
            for r in replicas:
                print(f"replica {r.index} ready: {r.url} (pid {r.pid}, log {r.log_path}, "
                      f"{r.started_s:.1f} s)", flush=True)  # fmt: skip
            await anyio.sleep_forever()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = parse_args(argv)
        anyio.run(_serve, config)
    except AsyncGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
