"""zerodp's packages import each other in one direction, and the tree shows the tiers.

Modules have no import cycle (shared/tools/imports.py checks that); this test checks the coarser graph whose
nodes are zerodp's packages: the first-level ones (`zerodp.config`, `zerodp.offload`, ...; a top-level module
such as `errors` is its own node), and inside the three folders that only group packages (`shard/`, `adapters/`,
`tools/`) the second-level ones (`shard.stage3`, `adapters.deepspeed`, `tools.cli`, ...). An edge is any
import, at module level or inside a function, from a module of one node to a module of another; imports of
the root package `zerodp` itself (its public API) are not edges. A cycle fails with the modules that make each edge.

The tiers (issues 33 and 43) are read from the tree, not from a list: `zerodp/adapters/` holds the adapters
(a dialect: DeepSpeed's, Hugging Face's, VISSL's), `zerodp/tools/` what is built on the runtime (the planners,
the CLI, the `zerodp train` application, the bundled models), and every other package is the runtime (what
trains: the engine and everything below `initialize`). The runtime imports no adapter and no tool.

A few packages promise a tighter bound in their docstring, checked here too: `config.vissl` (VISSL's dialect,
translated) is pure config, so it imports no torch and no zerodp module but `errors`; `tools.models` (the
bundled GPT) is a library model any layer may import, so it imports no zerodp package but `tensor_parallel`
(Megatron's layers, for the tensor-parallel GPT), which imports none; `tools.app` (the `zerodp train`
application) is above the library: only `tools.cli` imports it.

Each package's docstring maps its modules: every module and subpackage is named in it (`name.py`, `name/`).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = SRC / "zerodp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of zerodp modules (or packages) that `path` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("zerodp"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("zerodp"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` names a module
    return out


# folders that only group packages: their subpackages are the graph's nodes
NAMESPACES = ("shard", "adapters", "tools")


def _node(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in NAMESPACES and (ROOT / parts[1] / parts[2]).is_dir():
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def package_graph() -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: [importing modules]}}."""
    graph: dict[str, dict[str, list[str]]] = {}
    known = {_node(_module_name(p)) for p in ROOT.rglob("*.py")}
    for path in ROOT.rglob("*.py"):
        src = _node(_module_name(path))
        for target in _imports(path):
            dst = _node(target)
            if dst and dst in known and dst != src and src:
                graph.setdefault(src, {}).setdefault(dst, []).append(_module_name(path))
    return graph


def _cycles(graph: dict[str, dict]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _third_party(path: Path) -> set[str]:
    """Top-level names of the non-zerodp modules `path` imports (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {"zerodp", "__future__"}


# node: (zerodp nodes it may import, third-party modules it must not import)
BOUNDED = {"tools.models": ({"tensor_parallel"}, set()), "tensor_parallel": (set(), set())}
# config.vissl is a subpackage of config, so its bound is on modules: zerodp modules it may import
VISSL_DIALECT, VISSL_ALLOWED = "zerodp.config.vissl", ("zerodp.config.vissl", "zerodp.errors")


def test_bounded_packages_import_only_what_they_promise():
    graph = package_graph()
    for package, (allowed, banned) in BOUNDED.items():
        folder = ROOT.joinpath(*package.split("."))
        assert (folder / "__init__.py").exists(), f"zerodp.{package} is gone: update BOUNDED"
        extra = {dst: mods for dst, mods in graph.get(package, {}).items() if dst not in allowed}
        assert not extra, f"zerodp.{package} may import only {sorted(allowed)}; it imports {extra}"
        for path in folder.rglob("*.py"):
            found = _third_party(path) & banned
            assert not found, f"{_module_name(path)} imports {sorted(found)}; zerodp.{package} promises it does not"


def test_the_vissl_dialect_is_pure_config():
    folder = ROOT / "config" / "vissl"
    assert (folder / "__init__.py").exists(), "zerodp.config.vissl is gone: update VISSL_DIALECT"
    for path in folder.rglob("*.py"):
        assert "torch" not in _third_party(path), f"{_module_name(path)} imports torch; the VISSL dialect is pure config"
        extra = sorted(t for t in _imports(path) if _exists(t) and not t.startswith(VISSL_ALLOWED))
        assert not extra, f"{_module_name(path)} imports {extra}; zerodp.config.vissl may import only {VISSL_ALLOWED}"


def test_only_the_cli_imports_the_app():
    importers = {src: sorted(set(mods["tools.app"])) for src, mods in package_graph().items()
                 if "tools.app" in mods and src != "tools.cli"}
    assert not importers, f"the library imports the `zerodp train` application (only cli may): {importers}"


def test_no_package_level_import_cycle():
    graph = package_graph()
    cycles = _cycles(graph)
    detail = [f"{a} -> {b} ({', '.join(sorted(set(graph[a][b]))[:3])})" for c in cycles for a in c for b in graph.get(a, {})
              if b in c]
    assert not cycles, f"package-level import cycles {cycles}:\n" + "\n".join(detail)


# The tiers are folders: zerodp/adapters/ and zerodp/tools/; every other package is the runtime.
TIER_FOLDERS = {"adapters": "adapter", "tools": "planner"}


def tier_of(module: str) -> str:
    """The tier of zerodp module `module`, from the folder it lives in; "" for the root package."""
    rel = module.removeprefix("zerodp").removeprefix(".")
    if rel in ("", "__main__"):
        return ""  # the public API (`zerodp`) and `python -m zerodp`: above every tier, imported by none
    return TIER_FOLDERS.get(rel.split(".")[0], "runtime")


def tier_violations() -> list[str]:
    """'runtime module -> adapter/planner module' for every import that runs up out of the runtime."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        if tier_of(name) != "runtime":
            continue
        for target in sorted(_imports(path)):
            if target in ("zerodp", "zerodp.__main__") or not _exists(target):
                continue
            if tier_of(target) != "runtime":
                out.append(f"{name} -> {target} ({tier_of(target)})")
    return out


def _exists(module: str) -> bool:
    """`from .x import name` records `x.name` too, which is a module only sometimes."""
    rel = Path(*module.split("."))
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


def test_the_tiers_are_folders():
    assert tier_of("zerodp.shard.stage3.strategy") == "runtime"
    assert tier_of("zerodp.adapters.deepspeed.engine") == "adapter"
    assert tier_of("zerodp.tools.cli.main") == "planner"
    top = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__" and not p.name.endswith(".pyc"))
    assert len(top) <= 18, f"src/zerodp has {len(top)} entries at the top ({top}): group them by tier (issue 43)"


def _package_map_names(doc: str) -> set[str]:
    """Names a package docstring maps: `name.py` or `name/` at the start of an indented line."""
    import re
    return set(re.findall(r"^[ \t]*([A-Za-z_]\w*(?:\.py|/))(?=[ \t,]|$)", doc, flags=re.M))


def test_every_package_docstring_maps_its_modules():
    missing = {}
    for init in sorted(ROOT.rglob("__init__.py")):
        folder = init.parent
        if folder == ROOT:
            continue  # the root's docstring is the quick start; the README and docs/layout.md map the top level
        doc = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
        named = _package_map_names(doc)
        members = {p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        members |= {p.name + "/" for p in folder.iterdir() if (p / "__init__.py").exists()}
        lacking = sorted(members - named)
        stale = sorted(n for n in named - members if n.endswith(".py"))
        if lacking or stale:
            missing[_module_name(init)] = {"not in the map": lacking, "mapped but absent": stale}
    assert not missing, "package docstrings must map their modules (name.py / name/ at the start of a line):\n" + \
        "\n".join(f"  {k}: {v}" for k, v in missing.items())


def test_the_runtime_imports_no_adapter_and_no_planner():
    violations = tier_violations()
    assert not violations, ("runtime modules import above their tier (move the function to the runtime side, or "
                            "invert the dependency):\n  " + "\n  ".join(violations))


# modules at the top that every tier may import, because they import no zerodp module (docs/layout.md)
LEAVES = ("errors.py", "host_memory.py")


def test_the_leaves_at_the_top_import_no_zerodp_module():
    for leaf in LEAVES:
        imports = sorted(t for t in _imports(ROOT / leaf) if _exists(t))
        assert not imports, f"zerodp/{leaf} is a leaf (docs/layout.md: every package uses it), but imports {imports}"


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
