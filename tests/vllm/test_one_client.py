"""vLLM's HTTP API has one client, :mod:`asyncgrpo.vllm`: no other module of the package opens an
HTTP connection to a replica (or to the proxy's OpenAI routes, which are vLLM's) itself.

Read from the source (``ast``), so a deferred import cannot hide one. A module outside
``asyncgrpo/vllm/`` counts when it makes HTTP client connections (aiohttp's client, httpx,
requests, urllib.request, http.client, the OpenAI SDK, raw asyncio connections) and they are
vLLM's: one of vLLM's routes (a path of :mod:`asyncgrpo.vllm.api`, by name or as a literal) is
named in it, in a module it imports (a session handed to a client that names the path), or in a
module importing it (a pool that another module sends the paths through). Connections to object
stores, a launch's MinIO or an emulator name no route and do not count.
``pytest tests/vllm/test_one_client.py -s`` prints the figure.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgrpo
from asyncgrpo.vllm import api

ROOT = Path(asyncgrpo.__file__).resolve().parent

#: Modules that may talk to vLLM themselves, each with the reason.
ALLOWED = {
    "asyncgrpo.proxy.http.h1": "the connections of the proxy's upstream pool (proxy/upstream.py): "
    "raw HTTP/1.1 on llhttp, since aiohttp's CPU per request is more than the proxy's routing "
    "takes; every path and rule it sends comes from vllm/api.py",
}

#: What a module calls to make an HTTP client connection, by library.
CLIENT_CALLS = {
    "aiohttp": {"ClientSession", "TCPConnector", "UnixConnector", "request"},
    "httpx": {"Client", "AsyncClient", "get", "post", "put", "delete", "request", "stream"},
    "requests": {"Session", "get", "post", "put", "patch", "delete", "head", "request"},
    "urllib.request": {"urlopen", "build_opener"},
    "http.client": {"HTTPConnection", "HTTPSConnection"},
    "openai": {"OpenAI", "AsyncOpenAI"},
    "asyncio": {"open_connection", "open_unix_connection"},
}
_CLIENT_NAMES = {f"{lib}.{name}" for lib, names in CLIENT_CALLS.items() for name in names}

#: vLLM's routes as :mod:`asyncgrpo.vllm.api` names them: ``{constant name: path}``.
ROUTES = {
    name: value
    for name, value in vars(api).items()
    if name.endswith(("_PATH", "_JSON")) and isinstance(value, str) and value.startswith("/")
}
_ROUTE_TEXT = {v for v in ROUTES.values()} | {v.encode() for v in ROUTES.values()}


def _modules(root: Path) -> dict[str, ast.Module]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text())
    return out


def _dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` of a name or an attribute chain, its first name replaced by what it imports."""
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bound)
        return None if base is None else f"{base}.{node.attr}"
    if isinstance(node, ast.Name):
        return bound.get(node.id, node.id)
    return None


def _bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> the module or object it imports (``import a.b`` binds ``a``)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def makes_connections(tree: ast.Module) -> bool:
    """The module uses an HTTP client library's client (or opens raw asyncio connections)."""
    bound = _bindings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute | ast.Name) and _dotted(node, bound) in _CLIENT_NAMES:
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "create_connection"  # an event loop's: asyncio transports
            and _dotted(node.func.value, bound) != "socket"  # a plain TCP probe is no HTTP
        ):
            return True
    return False


def names_a_route(tree: ast.Module) -> bool:
    """The module names one of vLLM's routes: an ``api`` constant, or the path as a literal."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            value = node.value
            sep = "?" if isinstance(value, str) else b"?"
            if value.partition(sep)[0] in _ROUTE_TEXT:  # type: ignore[arg-type]
                return True
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncgrpo.vllm.api":
            if any(a.name in ROUTES for a in node.names):
                return True
        elif isinstance(node, ast.Attribute) and node.attr in ROUTES:
            if isinstance(node.value, ast.Name) and node.value.id == "api":
                return True
    return False


def _imports(tree: ast.Module, modules: dict[str, ast.Module]) -> set[str]:
    """The package's modules ``tree`` imports (anywhere in it)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def vllm_clients(root: Path = ROOT) -> list[str]:
    """The modules outside ``asyncgrpo.vllm`` that open HTTP connections to vLLM themselves:
    modules making connections, with a vLLM route named in the module, in one it imports, or in
    one importing it."""
    modules = _modules(root)
    own = {m for m in modules if m == "asyncgrpo.vllm" or m.startswith("asyncgrpo.vllm.")}
    connects = {m for m, tree in modules.items() if m not in own and makes_connections(tree)}
    routes = {m for m, tree in modules.items() if m not in own and names_a_route(tree)}
    imports = {m: _imports(tree, modules) - own for m, tree in modules.items()}
    users: dict[str, set[str]] = {m: set() for m in modules}
    for u, targets in imports.items():
        for m in targets:
            users[m].add(u)
    return sorted(m for m in connects if ({m} | imports[m] | users[m]) & routes)


def test_only_vllm_talks_to_vllm() -> None:
    found = vllm_clients()
    others = [m for m in found if m not in ALLOWED]
    print(
        f"\nmodules outside asyncgrpo/vllm/ that open HTTP connections to vLLM: {len(others)}"
        f" (and {len(set(found) & set(ALLOWED))} allowed: the proxy's upstream pool)"
    )
    for m in others:
        print(f"  {m}")
    assert others == [], "use asyncgrpo.vllm.client.VLLMClient (docs/architecture.md, section 3)"
    assert set(ALLOWED) <= set(found), "an allowed module no longer talks to vLLM: drop it"


def test_a_new_client_is_found(tmp_path: Path) -> None:
    """Connections and a vLLM path in one module, or split over two (a session handed to a
    client, a raw pool that another module sends paths through), are counted; connections aimed
    elsewhere, a TCP probe, or a module using only VLLMClient are not."""
    pkg = tmp_path / "asyncgrpo"
    (pkg / "rollout").mkdir(parents=True)
    (pkg / "vllm").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "vllm" / "client.py").write_text(
        "import aiohttp\nPATH = '/v1/completions'\nS = aiohttp.ClientSession\n"
    )
    files = {
        "direct": "import aiohttp\n"
        "async def f(url):\n"
        "    async with aiohttp.ClientSession() as s:\n"
        "        return await s.get(url + '/metrics')\n",
        "named": "from aiohttp import ClientSession\n"
        "from asyncgrpo.vllm.api import COMPLETIONS_PATH\n"
        "S, P = ClientSession, COMPLETIONS_PATH\n",
        "speaks": "from asyncgrpo.vllm import api\n"
        "def url(base):\n    return base + api.SERVER_INFO_JSON\n",
        "pools": "import aiohttp\nfrom asyncgrpo.rollout import speaks\nS = aiohttp.TCPConnector\n",
        "elsewhere": "import urllib.request\n"
        "def f():\n    urllib.request.urlopen('http://minio/bucket')\n",
        "seam": "from asyncgrpo.vllm.client import VLLMClient\nfrom asyncgrpo.vllm import api\n"
        "P = api.COMPLETIONS_PATH\n",
        "probe": "import socket\nfrom asyncgrpo.vllm.api import HEALTH_PATH\n"
        "socket.create_connection(('h', 1))\n",
        "raw": "async def f(loop):\n    await loop.create_connection(None, 'h', 1)\n",
        "sends": "from asyncgrpo.rollout.raw import f\nP = b'/v1/completions'\n",
    }
    for name, text in files.items():
        (pkg / "rollout" / f"{name}.py").write_text(text)
    found = vllm_clients(pkg)
    assert found == [
        "asyncgrpo.rollout.direct",
        "asyncgrpo.rollout.named",
        "asyncgrpo.rollout.pools",
        "asyncgrpo.rollout.raw",
    ]
