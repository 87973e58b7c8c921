"""zerodp's packages import each other in one direction: no package-level import cycle.

Modules have none either (shared/tools/imports.py checks that); this test checks the coarser graph
whose nodes are zerodp's first-level packages (`zerodp.config`, `zerodp.offload`, ...; top-level
modules such as `engine` count as their own node). An edge is any import, at module level or inside a
function, from a module of one node to a module of another; imports of the root package `zerodp`
itself (its public API) are not edges. A cycle fails with the modules that make each edge.

The tiers (issue 33): the runtime (what trains: the engine and everything below `initialize`) imports no
adapter (a dialect: DeepSpeed's, Hugging Face's, VISSL's) and no planner (an estimate before launch, the
scaling model, the CLI, the `zerodp train` application, the bundled model); those are built on the runtime.
`TIERS` names every module of zerodp by prefix, the longest matching prefix deciding (`memory`: what a live
rank holds, the runtime's; `plan`: the paper's formulas, the peak-RSS model, the offload estimate and the
scaling model, all estimates before launch). Every module must fall in a tier, so a new package is placed
on purpose.

A few packages promise a tighter bound in their docstring, checked here too: `vissl` (VISSL's dialect,
translated) is pure config, which `config` itself imports, so it imports no torch and no zerodp package
but `errors`; `models` (the bundled GPT) is a library model any layer may import, so it imports no zerodp
package but `tensor_parallel` (Megatron's layers, for the tensor-parallel GPT), which imports none; `app` (the `zerodp train` application) is above the library: only `cli` imports it.
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


def _node(module: str) -> str:
    parts = module.split(".")
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


# package: (zerodp packages it may import, third-party modules it must not import)
BOUNDED = {"vissl": ({"errors"}, {"torch"}), "models": ({"tensor_parallel"}, set()), "tensor_parallel": (set(), set())}


def test_bounded_packages_import_only_what_they_promise():
    graph = package_graph()
    for package, (allowed, banned) in BOUNDED.items():
        assert (ROOT / package / "__init__.py").exists(), f"zerodp.{package} is gone: update BOUNDED"
        extra = {dst: mods for dst, mods in graph.get(package, {}).items() if dst not in allowed}
        assert not extra, f"zerodp.{package} may import only {sorted(allowed)}; it imports {extra}"
        for path in (ROOT / package).rglob("*.py"):
            found = _third_party(path) & banned
            assert not found, f"{_module_name(path)} imports {sorted(found)}; zerodp.{package} promises it does not"


def test_only_the_cli_imports_the_app():
    importers = {src: sorted(set(mods["app"])) for src, mods in package_graph().items()
                 if "app" in mods and src != "cli"}
    assert not importers, f"the library imports the `zerodp train` application (only cli may): {importers}"


def test_no_package_level_import_cycle():
    graph = package_graph()
    cycles = _cycles(graph)
    detail = [f"{a} -> {b} ({', '.join(sorted(set(graph[a][b]))[:3])})" for c in cycles for a in c for b in graph.get(a, {})
              if b in c]
    assert not cycles, f"package-level import cycles {cycles}:\n" + "\n".join(detail)


# The tiers as the packages are named today (update with the layout): module prefixes under zerodp.
TIERS = {
    "runtime": ("engine", "sharding", "runtime", "config", "comm", "flat", "grads", "stage12", "stage3", "optim",
                "offload", "checkpoint", "precision", "autocast", "monitor", "memory", "host_memory", "seams", "errors",
                "nonfinite", "preflight", "module_device", "placement", "activations", "tensor_parallel"),
    "adapter": ("deepspeed", "integrations", "vissl"),
    "planner": ("plan", "cli", "app", "models"),
}


def tier_of(module: str) -> str:
    """The tier of zerodp module `module` (its longest prefix in TIERS); "" for the root package."""
    rel = module.removeprefix("zerodp").removeprefix(".")
    if rel in ("", "__main__"):
        return ""  # the public API (`zerodp`) and `python -m zerodp`: above every tier, imported by none
    matches = [(len(prefix), tier) for tier, prefixes in TIERS.items() for prefix in prefixes
               if rel == prefix or rel.startswith(prefix + ".")]
    assert matches, f"{module} is in no tier: add it to TIERS in tests/unit/test_layering.py"
    return max(matches)[1]


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


def test_every_module_is_in_a_tier():
    for path in ROOT.rglob("*.py"):
        tier_of(_module_name(path))


def test_the_runtime_imports_no_adapter_and_no_planner():
    violations = tier_violations()
    assert not violations, ("runtime modules import above their tier (move the function to the runtime side, or "
                            "invert the dependency):\n  " + "\n  ".join(violations))


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
