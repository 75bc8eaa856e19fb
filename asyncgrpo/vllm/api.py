"""vLLM's HTTP API as asyncgrpo speaks it: the paths, the served-name rule, the load rules, and
readers of vLLM's answers (JSON documents and error bodies).

Pure and free of any HTTP client, so that the proxy (its own HTTP/1.1), the vLLM plugin (inside
vLLM's FastAPI) and :class:`~asyncgrpo.vllm.client.VLLMClient` all read vLLM the same way without
loading aiohttp. Error readers exist because a status alone is ambiguous: a 404 from
``/v1/load_lora_adapter`` with no ``No adapter found`` in the body means the runtime LoRA routes
are off, not that the adapter is missing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# vLLM's routes (the development ones need ``VLLM_SERVER_DEV_MODE=1``).
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
METRICS_PATH = "/metrics"
PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
SERVER_INFO_PATH = "/server_info"
#: Where a replica describes its configuration as JSON.
SERVER_INFO_JSON = SERVER_INFO_PATH + "?config_format=json"

# Routes of asyncgrpo's vLLM endpoint plugin (asyncgrpo.serve.vllm_plugin): the replica fetches a
# published version from the transport itself. Under /v1, so vLLM's --api-key guards them.
PLUGIN_LOAD_PATH = "/v1/asyncgrpo/load"
PLUGIN_UNLOAD_PATH = "/v1/asyncgrpo/unload"
PLUGIN_INFO_PATH = "/v1/asyncgrpo/info"

#: vLLM's words for a load whose path holds no adapter (yet: storage may lag).
ADAPTER_NOT_FOUND = "No adapter found"
#: vLLM's words for a request naming a model (an adapter) it does not serve: ``The model `x`
#: does not exist.`` (an OpenAI ``NotFoundError``, status 404).
MODEL_NOT_SERVED = "does not exist"
#: Error type of a plugin load whose version is not (yet) published: worth retrying.
ADAPTER_NOT_PUBLISHED = "AdapterNotPublished"
#: What to do about a replica without the plugin (or one that may not fetch from the transport).
PLUGIN_FIX = (
    "install asyncgrpo in the replica's Python environment and start vLLM with "
    "VLLM_PLUGINS=asyncgrpo and ASYNCGRPO_ADAPTER_TRANSPORTS=<transport url> "
    "(`python -m asyncgrpo.serve --transport URL` does both), or set "
    "serve.adapter_delivery=path if the replicas share the trainer's filesystem"
)

#: The largest adapter version: at most 18 digits (< 2**63).
MAX_VERSION = 10**18 - 1
# At most 18 digits (< 2**63), no leading zero: parsing never runs an unbounded int() and a
# parsed name is exactly the name served_name gives back.
_SERVED = re.compile(r"(.+)-v(0|[1-9][0-9]{0,17})")
_URI_VERSION = re.compile(r"v([0-9]{1,18})")


def served_name(prefix: str, version: int) -> str:
    """The name vLLM serves version ``version`` of adapter ``prefix`` under: ``<prefix>-v<N>``.

    A new name per version, since vLLM keys its prefix cache by adapter name: a reused name
    would mix KV computed with old weights into answers of the new ones.
    """
    if not prefix or isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(
            f"served_name needs a prefix and an int version, got {prefix!r}, {version!r}"
        )
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"adapter version must be 0 to {MAX_VERSION}, got {version}")
    return f"{prefix}-v{version}"


def parse_served_name(name: str) -> tuple[str, int] | None:
    """``(prefix, version)`` of a name :func:`served_name` gives, else None (a base model, any
    other name, or a "version" of more than 18 digits)."""
    match = _SERVED.fullmatch(name)
    return (match[1], int(match[2])) if match else None


def uri_served_name(uri: str) -> str | None:
    """The one name a plugin load of ``uri`` (``<root>/[<prefix>/]<name>/v<N>``) may serve the
    version under, ``<name>-v<N>``; None when the URI names no version."""
    parts = uri.rsplit("/", 2)
    version = _URI_VERSION.fullmatch(parts[-1])
    if len(parts) < 3 or not parts[1] or version is None:
        return None
    return served_name(parts[1], int(version[1]))


def name_refusal(body: Mapping[str, Any]) -> str | None:
    """Why a load or unload body names no adapter, or None."""
    name = body.get("lora_name")
    return None if isinstance(name, str) and name else "lora_name must be a non-empty string"


def load_refusal(body: Mapping[str, Any]) -> str | None:
    """Why a load (vLLM's or the plugin's) must not reach vLLM, or None: it names the adapter,
    and never asks ``load_inplace``, since a served name never changes weights (vLLM keys its
    prefix cache by name). The proxy's rule and the plugin's."""
    if why := name_refusal(body):
        return why
    if body.get("load_inplace"):
        return (
            "load_inplace is refused: a served name never changes weights (vLLM keys its prefix "
            "cache by name); publish a new version under a new name"
        )
    return None


def uri_refusal(name: str, uri: object) -> str | None:
    """Why a plugin load may not serve ``uri`` as ``name``, or None: the URI must name a version
    and ``name`` must be that version's served name (a name means one version's weights)."""
    if not isinstance(uri, str) or not uri:
        return "lora_uri must be a non-empty string"
    if (want := uri_served_name(uri)) is None:
        return "lora_uri must end in <adapter name>/v<N> (an AdapterStore version)"
    if name != want:
        return f"lora_name {name!r} must be {want!r}, the version lora_uri names"
    return None


def unload_body(name: str) -> dict[str, str]:
    """The body of an unload (vLLM's route or the plugin's): the served name, nothing else."""
    return {"lora_name": name}


def unload_path(load_path: str) -> str:
    """The route that unloads an adapter loaded through ``load_path``."""
    return PLUGIN_UNLOAD_PATH if load_path == PLUGIN_LOAD_PATH else UNLOAD_LORA_PATH


def already_loaded(status: int, body: bytes | str) -> bool:
    """A load refused because the replica already holds an adapter of that name."""
    return status == 400 and ("already" in body if isinstance(body, str) else b"already" in body)


def adapter_not_there_yet(status: int, body: bytes | str) -> bool:
    """True for a load refused only because the version has not reached the replica yet."""
    mark: bytes | str
    if status == 404:
        mark = ADAPTER_NOT_FOUND
    elif status == 409:
        mark = ADAPTER_NOT_PUBLISHED
    else:
        return False
    if isinstance(body, bytes):
        mark = mark.encode()
    return mark in body  # type: ignore[operator]


def lora_routes_off(status: int, body: str) -> bool:
    """A 404 from ``/v1/load_lora_adapter`` that is vLLM's "no such route", not a missing
    adapter: runtime LoRA loading is off."""
    return status == 404 and ADAPTER_NOT_FOUND not in body


def plugin_missing(status: int, body: str) -> bool:
    """A 404 from the plugin's load route that is "no such route": the plugin is not loaded."""
    return status == 404 and ADAPTER_NOT_PUBLISHED not in body


def model_not_served(status: int, body: str) -> bool:
    """A generation refused because the replica does not serve that model (an adapter not
    loaded yet, or unloaded), not a 404 of a wrong route."""
    return status == 404 and MODEL_NOT_SERVED in error_message(body)


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body (vLLM's, the proxy's), else the body itself."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:500]
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else text[:500]


def model_ids(body: bytes | str) -> list[str]:
    """The served names of a ``/v1/models`` answer; ValueError if it is not vLLM's document."""
    doc = json.loads(body)
    data = doc.get("data", []) if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"not a /v1/models document: {str(body)[:200]}")
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def loads_in_progress(url: str, status: int, body: bytes | str) -> list[str]:
    """The adapter loads a replica's plugin (``GET /v1/asyncgrpo/info``, ``loading``), or the
    replicas of a proxy, are still working on; none from a replica without the plugin."""
    return sorted(
        str(name)
        for entry in plugin_answers(url, status, body)
        if isinstance(info := entry.get("info"), dict) and isinstance(info.get("loading"), list)
        for name in info["loading"]
    )


def plugin_answers(url: str, status: int, body: bytes | str) -> list[dict[str, Any]]:
    """Entries of a ``GET /v1/asyncgrpo/info`` answer from ``url``: ``url``, ``status`` and
    either ``info`` (the plugin's JSON) or ``body``; a proxy's answer lists its replicas'."""
    try:
        doc = json.loads(body) if status == 200 else None
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("replicas"), list):
        return doc["replicas"]  # a proxy's broadcast
    if isinstance(doc, dict):
        return [{"url": url, "status": status, "info": doc}]
    text = body[:300].decode(errors="replace") if isinstance(body, bytes) else body[:300]
    return [{"url": url, "status": status, "body": text}]


def _server_setting(info: Any, section: str, name: str) -> int | None:
    """``vllm_config.<section>.<name>`` from a ``/server_info`` document, if it says (an int)."""
    if not isinstance(info, dict):
        return None
    cfg = info.get("vllm_config", info)
    part = cfg.get(section) if isinstance(cfg, dict) else None  # a string in some versions
    value = part.get(name) if isinstance(part, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def block_size_of(info: Any) -> int | None:
    """``vllm_config.cache_config.block_size`` from a ``/server_info`` document, if it says."""
    return _server_setting(info, "cache_config", "block_size")


def lora_slots_of(info: Any) -> int | None:
    """The replica's ``--max-loras`` (None: LoRA off, or the document does not say)."""
    return _server_setting(info, "lora_config", "max_loras")


def max_num_seqs_of(info: Any) -> int | None:
    """The replica's ``--max-num-seqs``: sequences it runs at once; beyond, it queues them."""
    return _server_setting(info, "scheduler_config", "max_num_seqs")


def max_model_len_of(info: Any) -> int | None:
    """The replica's ``--max-model-len``: prompt plus generated tokens of one request."""
    return _server_setting(info, "model_config", "max_model_len")


def max_logprobs_of(info: Any) -> int | None:
    """The replica's ``--max-logprobs``: the most top logprobs one position may return."""
    return _server_setting(info, "model_config", "max_logprobs")


def context_length_refusal(status: int, body: bytes | str) -> bool:
    """vLLM refused a request for being longer than its ``--max-model-len`` (400)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    return status == 400 and ("maximum context length" in text or "max_model_len" in text)
