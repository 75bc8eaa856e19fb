"""One endpoint in front of many vLLM replicas: KV-prefix-affinity routing, health, broadcast.

``python -m asyncgrpo.proxy --upstream URL --upstream URL`` or, in-process,
``async with serve_proxy(ProxyConfig(upstreams=(...), port=0)) as url: ...``.
Runs on the light core (its HTTP on httptools; uvloop and orjson if installed), never torch.
"""

from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.router import Decision, Router, request_hashes
from asyncgrpo.proxy.server import serve_proxy

__all__ = ["Decision", "ProxyConfig", "Router", "request_hashes", "serve_proxy"]
