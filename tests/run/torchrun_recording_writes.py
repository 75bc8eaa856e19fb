"""The real ``asyncgrpo`` command for torchrun in tests, recording every write to a local
transport as a ``<rank> <operation> <key>`` line in the file ``$ASYNCGRPO_WRITE_LOG``.

Usage: ``torchrun --nproc-per-node 2 tests/run/torchrun_recording_writes.py train CONFIG``.
"""

from __future__ import annotations

import functools
import os
import sys

import anyio

from asyncgrpo.cli.main import main
from asyncgrpo.transport.local import LocalTransport


def _record(name: str) -> None:
    original = getattr(LocalTransport, name)

    @functools.wraps(original)
    async def recorded(self, key, *args, **kwargs):
        line = f"{os.environ.get('RANK', '0')} {name} {key}\n"
        async with await anyio.open_file(os.environ["ASYNCGRPO_WRITE_LOG"], "a") as log:
            await log.write(line)
        return await original(self, key, *args, **kwargs)

    setattr(LocalTransport, name, recorded)


for _name in ("put", "put_file", "delete"):
    _record(_name)

if __name__ == "__main__":
    main(sys.argv[1:])
