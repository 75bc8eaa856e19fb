"""asyncgrpo's import graph: no cycle, and imports only go down the layers.

A cycle means two modules each need the other: a concept split in the wrong place. The graph is
read from the source (``ast``), so a deferred import inside a function cannot hide one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import asyncgrpo

ROOT = Path(asyncgrpo.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the asyncgrpo modules it imports (a package's ``__init__`` is the package)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
        graph[name] = {t for t in targets if t and t != name and t.startswith("asyncgrpo")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert graph["asyncgrpo.proxy.http.h1"]  # the graph sees inside packages
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- layers ---------------------------------------------------------------------------------
#: The package's layers, lowest first, each a name and its folders (packages under
#: ``asyncgrpo/``, or base modules directly under it): a module is in its folder's layer and may
#: import only from its own layer or below (docs/architecture.md has the same table).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "lazy", "console", "processes", "parent_death", "retry", "sample")),
    ("config", ("config",)),
    ("vllm", ("vllm",)),
    ("transport", ("transport",)),
    ("store", ("store",)),
    ("components", ("trainer", "rollout", "proxy", "serve", "rewards", "evaluation")),
    ("run", ("run", "tinker")),
    ("launch", ("launch",)),
    ("testing", ("testing",)),
    ("cli", ("cli", "__main__")),
]
#: Modules directly under ``asyncgrpo/`` (the package's ``__init__`` counts as ``asyncgrpo``).
MAX_LOOSE = 9


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of an ``asyncgrpo`` module's folder (``asyncgrpo``: 0)."""
    if module == "asyncgrpo":
        return 0
    folder = module.split(".")[1]
    for index, (_, folders) in enumerate(LAYERS):
        if folder in folders:
            return index
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer to a higher one (the root ``asyncgrpo`` maps every layer's
    names lazily and imports none of them)."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if a != "asyncgrpo" and layer_of(b) > layer_of(a)
    )


def layer_graph(graph: dict[str, set[str]]) -> Counter[tuple[int, int]]:
    """(importing layer, imported layer) -> how many module imports go from one to the other."""
    return Counter(
        (layer_of(a), layer_of(b))
        for a, targets in graph.items()
        if a != "asyncgrpo"
        for b in targets
    )


def format_layer_graph(graph: dict[str, set[str]]) -> str:
    """The layer graph, one line per pair of layers, upward imports marked ``UP``."""

    def label(index: int) -> str:
        return f"{index + 1:>2} {LAYERS[index][0]}"

    return "\n".join(
        f"  {label(a):<14} -> {label(b):<14} {n:>4}{'  UP' if b > a else ''}"
        for (a, b), n in sorted(layer_graph(graph).items())
    )


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_imports_only_go_down() -> None:
    """Prints the figures (``pytest tests/test_imports.py -q -s``): the imports from a lower
    layer to a higher one (0), the layer graph, the imports between components."""
    graph = import_graph()
    upward = upward_edges(graph)
    print(f"\nimports from a lower layer to a higher one: {len(upward)}")
    print(f"imports from one component into another: {len(component_edges(graph))}")
    print(f"the layer graph (importing -> imported, module imports):\n{format_layer_graph(graph)}")
    assert upward == [], (
        f"{len(upward)} imports go up the layers:\n  "
        + "\n  ".join(upward)
        + f"\nthe layer graph (importing -> imported, module imports):\n{format_layer_graph(graph)}"
    )


def test_an_upward_import_is_found() -> None:
    graph = {
        "asyncgrpo.config.training": {"asyncgrpo.run.training"},
        "asyncgrpo.config.proxy": {"asyncgrpo.proxy.http.h1", "asyncgrpo.errors"},
        "asyncgrpo.run.training": {"asyncgrpo.config.training", "asyncgrpo.trainer.loop"},
    }
    assert upward_edges(graph) == [
        "asyncgrpo.config.proxy -> asyncgrpo.proxy.http.h1",
        "asyncgrpo.config.training -> asyncgrpo.run.training",
    ]
    assert layer_graph(graph) == {(1, 0): 1, (1, 5): 1, (1, 6): 1, (6, 1): 1, (6, 5): 1}
    assert [" ".join(line.split()) for line in format_layer_graph(graph).splitlines()] == [
        "2 config -> 1 base 1",
        "2 config -> 6 components 1 UP",
        "2 config -> 7 run 1 UP",
        "7 run -> 2 config 1",
        "7 run -> 6 components 1",
    ]


DOC = ROOT.parent / "docs" / "architecture.md"


def doc_layers() -> list[tuple[str, tuple[str, ...]]]:
    """The layer table of docs/architecture.md: each row's name and its folders."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            folders = tuple(
                token.removeprefix("asyncgrpo/").removesuffix(".py").rstrip("/")
                for token in re.findall(r"`([^`]+)`", cells[2])
            )
            rows.append((cells[1], folders))
    return rows


def test_the_documented_layer_table_is_the_one_enforced() -> None:
    """docs/architecture.md's table and :data:`LAYERS` name the same layers with the same
    folders in the same order: a package moved or added on one side only fails here."""
    assert [(name, set(f)) for name, f in doc_layers()] == [(name, set(f)) for name, f in LAYERS]


#: Imports from one component into another (layer 6), each with the reason docs/architecture.md
#: gives: section 6 lists the same, and any other import between components fails
#: :func:`test_components_import_no_other_component_but_the_documented_exceptions`.
COMPONENT_EXCEPTIONS = {
    ("asyncgrpo.rollout.policy", "asyncgrpo.proxy.http.headers"): "the proxy's header names",
    ("asyncgrpo.evaluation.runner", "asyncgrpo.proxy.http.headers"): "the run header",
    ("asyncgrpo.evaluation.runner", "asyncgrpo.rollout.dataset"): "an evaluation is a rollout",
    ("asyncgrpo.evaluation.runner", "asyncgrpo.rollout.environment"): "an evaluation is a rollout",
    ("asyncgrpo.evaluation.runner", "asyncgrpo.rollout.policy"): "an evaluation is a rollout",
    ("asyncgrpo.evaluation.runner", "asyncgrpo.rollout.rewards"): "an evaluation is a rollout",
    ("asyncgrpo.serve.__main__", "asyncgrpo.proxy.admin_client"): "--register joins a proxy",
}


def component_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from one component into another."""
    _, components = LAYERS[5]

    def component(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) >= 2 and parts[1] in components else None

    return {
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if component(a) and component(b) and component(a) != component(b)
    }


def _module_of(path: str) -> str:
    """``rollout/policy.py`` -> ``asyncgrpo.rollout.policy``."""
    return "asyncgrpo." + path.removesuffix(".py").replace("/", ".")


def doc_component_exceptions(text: str) -> set[tuple[str, str]]:
    """The imports between components that section 6 of docs/architecture.md lists, one bullet
    each importing module: ``- `a.py` imports `b.py` and `c.py`: the reason``."""
    section = text[text.index("\n## 6. ") : text.index("\n## 7. ")]
    found = set()
    for bullet in section.split("\n- ")[1:]:
        listed = re.match(r"`([^`]+)` imports (.+?): ", " ".join(bullet.split()))
        if listed:  # the other bullets describe a component
            importer, imported = listed.groups()
            found |= {
                (_module_of(importer), _module_of(b)) for b in re.findall(r"`([^`]+)`", imported)
            }
    return found


def test_components_import_no_other_component_but_the_documented_exceptions() -> None:
    found = component_edges(import_graph())
    listed = set(COMPONENT_EXCEPTIONS)
    assert found == listed, (
        f"imports between components not listed: {sorted(found - listed)}; "
        f"listed but not imported: {sorted(listed - found)}"
    )
    documented = doc_component_exceptions(DOC.read_text())
    assert documented == listed, (
        f"docs/architecture.md section 6 lists {sorted(documented - listed)} besides the test's "
        f"list and lacks {sorted(listed - documented)}"
    )


def test_an_import_between_components_is_found() -> None:
    graph = {
        "asyncgrpo.serve.replicas": {"asyncgrpo.trainer.loop", "asyncgrpo.config.serve"},
        "asyncgrpo.config.rollout": {"asyncgrpo.config.trainer"},
        "asyncgrpo.trainer.loop": {"asyncgrpo.store.adapters"},
    }
    assert component_edges(graph) == {("asyncgrpo.serve.replicas", "asyncgrpo.trainer.loop")}


def test_the_documented_exceptions_are_read() -> None:
    text = (
        "\n## 6. Components\n\n- `rollout/policy.py` imports `proxy/http/headers.py`: a reason;\n"
        "- `evaluation/runner.py` imports `rollout/dataset.py` and\n  `rollout/rewards.py`: a"
        " reason.\n\n- `trainer/`: one step (`loss.py`: the loss).\n\n## 7. run\n"
    )
    assert doc_component_exceptions(text) == {
        ("asyncgrpo.rollout.policy", "asyncgrpo.proxy.http.headers"),
        ("asyncgrpo.evaluation.runner", "asyncgrpo.rollout.dataset"),
        ("asyncgrpo.evaluation.runner", "asyncgrpo.rollout.rewards"),
    }


#: Where each heavy library may be imported (at module level or deferred): packages, or single
#: modules (docs/architecture.md says the same).
HEAVY_HOMES = {
    "torch": {"asyncgrpo.trainer", "asyncgrpo.tinker", "asyncgrpo.testing"},
    "peft": {"asyncgrpo.trainer", "asyncgrpo.tinker", "asyncgrpo.testing"},
    "transformers": {
        "asyncgrpo.trainer",
        "asyncgrpo.testing",
        "asyncgrpo.rollout.dataset",
        "asyncgrpo.cli.demo",
        "asyncgrpo.run.preflight",
    },
}


def heavy_imports() -> dict[str, set[str]]:
    """Heavy library -> the asyncgrpo modules that import it anywhere in their source."""
    found: dict[str, set[str]] = {name: set() for name in HEAVY_HOMES}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in found:
                    found[name.split(".")[0]].add(module)
    return found


def test_torch_peft_and_transformers_only_where_the_docs_say() -> None:
    for library, modules in heavy_imports().items():
        homes = HEAVY_HOMES[library]
        stray = sorted(
            m for m in modules if not any(m == h or m.startswith(h + ".") for h in homes)
        )
        assert stray == [], f"{library} imported outside {sorted(homes)}"
        unused = sorted(
            h for h in homes if not any(m == h or m.startswith(h + ".") for m in modules)
        )
        assert unused == [], f"{library}: docs/architecture.md names homes it has not: {unused}"
    text = DOC.read_text()
    for home in set().union(*HEAVY_HOMES.values()):
        parts = home.split(".")[1:]
        path = "/".join(parts) + ("/" if len(parts) == 1 else ".py")
        assert f"`{path}`" in text, f"docs/architecture.md does not say {path} imports them"


def test_few_loose_modules() -> None:
    loose = sorted(p.stem for p in ROOT.glob("*.py"))
    assert len(loose) <= MAX_LOOSE, loose


def _loaded_by(statement: str) -> set[str]:
    """The modules in ``sys.modules`` after ``statement`` runs in a fresh interpreter."""
    code = f"{statement}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


HEAVY = ("aiohttp", "torch", "transformers")


def _beyond_config(loaded: set[str]) -> list[str]:
    """Loaded ``asyncgrpo`` modules above the config layer (anything but ``config/`` and the
    base modules)."""
    return sorted(m for m in loaded if m.startswith("asyncgrpo.") and layer_of(m) > 1)


SECTIONS = ("rollout", "trainer", "proxy", "serve", "launch", "evaluation", "store", "tinker")


@pytest.mark.parametrize(
    "statement",
    [
        "import asyncgrpo.config",
        "from asyncgrpo.config import TrainingConfig",
        "import " + ", ".join(f"asyncgrpo.config.{section}" for section in SECTIONS),
    ],
)
def test_loading_a_config_loads_no_component(statement: str) -> None:
    """Prints the ``asyncgrpo`` modules each statement loads (``-s``)."""
    loaded = _loaded_by(statement)
    ours = sorted(m for m in loaded if m == "asyncgrpo" or m.startswith("asyncgrpo."))
    print(f"\n{statement}: {len(ours)} asyncgrpo modules loaded: {' '.join(ours)}")
    assert _beyond_config(loaded) == []
    assert [m for m in HEAVY if m in loaded] == []


def test_config_is_built_without_a_component() -> None:
    statement = (
        "from asyncgrpo.config import TrainingConfig\n"
        "from asyncgrpo.config.training import example_path\n"
        "TrainingConfig.from_yaml(example_path('examples/tiny_cpu.yaml'))"
    )
    loaded = _loaded_by(statement)
    assert _beyond_config(loaded) == []
    assert [m for m in HEAVY if m in loaded] == []


@pytest.mark.parametrize("statement", ["import asyncgrpo.proxy", "import asyncgrpo.proxy.server"])
def test_the_proxy_loads_no_aiohttp(statement: str) -> None:
    loaded = _loaded_by(statement)
    assert "aiohttp" not in loaded
    assert "torch" not in loaded


def test_the_proxy_loads_no_http_client() -> None:
    """The proxy speaks HTTP itself and reads vLLM through asyncgrpo.vllm.api: importing it (its
    server, its CLI) loads neither aiohttp nor httpx; only its admin client, for runs, does."""
    code = (
        "import sys, asyncgrpo.proxy, asyncgrpo.proxy.server, asyncgrpo.proxy.__main__,"
        " asyncgrpo.vllm.api;"
        "print(sorted(m for m in ('aiohttp', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
