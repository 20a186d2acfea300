"""The architecture as the imports draw it (README, "Layout of the code").

The direction is service -> workers -> merge; modules import each other in no
cycle; ``service.wire`` and ``service.client`` load neither Ray nor the server;
Ray is used only where the cluster is; only the GPU backend imports cupy.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("merge", "workers", "service")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports(path: pathlib.Path) -> set[str]:
    """Every module name an import statement anywhere in the file names (function-level ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return names


def top_levels(package: str) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in a package, by file."""
    return {str(p.relative_to(ROOT)): {n.split(".")[0] for n in imports(p)}
            for name, p in MODULES.items() if name.split(".")[0] == package}


def project_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    return {name: {n for n in imports(path) if n in MODULES and n != name} for name, path in MODULES.items()}


def test_merge_imports_only_the_standard_library_and_numpy():
    allowed = set(sys.stdlib_module_names) | {"numpy", "merge"}
    for path, names in top_levels("merge").items():
        assert names <= allowed, f"{path} imports {sorted(names - allowed)}"


@pytest.mark.parametrize("package", ["merge", "workers"])
def test_lower_layers_never_import_the_service(package):
    for path, names in top_levels(package).items():
        assert "service" not in names, f"{path} imports service"


def test_merge_never_imports_workers():
    for path, names in top_levels("merge").items():
        assert "workers" not in names, f"{path} imports workers"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, stack + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


def test_no_module_takes_part_in_an_import_cycle():
    graph = project_graph()
    assert "workers.rows" in graph["workers.gpu.backend"] and "service.wire.request" in graph["service.wire.json_codec"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_only_the_gpu_backend_imports_cupy():
    for package in PACKAGES:
        for path, names in top_levels(package).items():
            if "cupy" in names:
                assert path == "workers/gpu/backend.py", f"{path} imports cupy"


def test_ray_is_imported_only_where_the_cluster_is():
    allowed = ("service/cluster/", "service/contexts/directory.py", "service/app.py", "service/serve.py", "workers/actor.py")
    for package in PACKAGES:
        for path, names in top_levels(package).items():
            if "ray" in names:
                assert path.startswith(allowed), f"{path} imports ray"


@pytest.mark.parametrize("package, forbidden", [
    ("service.wire", {"service.cluster", "service.contexts", "service.routes", "service.app", "service.runtime",
                      "service.attention", "service.client"}),
    ("service.client", {"service.cluster", "service.contexts", "service.routes", "service.app", "service.runtime",
                        "service.attention", "service.middleware"}),
])
def test_wire_and_client_never_import_the_server(package, forbidden):
    for name, edges in project_graph().items():
        if name == package or name.startswith(package + "."):
            bad = {e for e in edges if any(e == f or e.startswith(f + ".") for f in forbidden)}
            assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("modules", [
    ["service.wire.json_codec", "service.wire.safetensors", "service.wire.kserve", "service.wire.request",
     "service.wire.negotiation", "service.wire.body"],
    ["service.client", "service.client.loadtest", "service.client.loadtest.cli"],
])
def test_wire_and_client_load_neither_ray_nor_the_web_framework(modules):
    # matplotlib too: the load test imports it only when it draws plots.
    code = (f"import sys; import {', '.join(modules)}; "
            "bad = sorted(m for m in ('ray', 'fastapi', 'uvicorn', 'starlette', 'matplotlib') if m in sys.modules); "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_nothing_imports_tests_or_benchmarks():
    for package in PACKAGES:
        for path, names in top_levels(package).items():
            assert not names & {"tests", "benchmarks"}, path
