"""The architecture as the imports draw it (README, "Layout of the code").

The direction is service -> workers -> merge; modules import each other in no
cycle; ``service.wire`` and ``service.client`` load neither Ray nor the server;
Ray is used only where the cluster is; only the GPU backend imports cupy.
"""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("merge", "workers", "service")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


@functools.cache  # each test walks every file; parsed once per process
def imports(path: pathlib.Path) -> frozenset[str]:
    """Every module name an import statement anywhere in the file names (function-level ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return frozenset(names)


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


#: The README's "may import" table: each package, and the packages of this project it may import
#: (itself always). ``service`` is the top level: the app, routes, CLI and servers, which import anything.
MAY_IMPORT: dict[str, set[str]] = {
    "merge": set(),
    "workers": {"merge"},
    "service.core": {"workers"},
    "service.wire": {"service.core", "workers"},
    "service.client": {"service.wire", "service.core", "workers"},
    "service.cluster": {"service.core", "workers", "merge"},
    "service.contexts": {"service.cluster", "service.core", "service.wire", "workers", "merge"},
    "service.hf": {"service.client"},
}


def package_of(module: str) -> str:
    """The row of MAY_IMPORT a module belongs to (``service.wire.rules`` -> ``service.wire``), or the top
    level ``service`` for the app's own modules."""
    for name in sorted(MAY_IMPORT, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return module.split(".")[0]


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_package_imports_only_what_the_readme_table_allows(package):
    allowed = MAY_IMPORT[package] | {package}
    for name, edges in project_graph().items():
        if package_of(name) == package:
            bad = sorted(e for e in edges if package_of(e) not in allowed)
            assert not bad, f"{name} imports {bad}; {package} may import {sorted(allowed)}"


def readme_table() -> dict[str, set[str]]:
    """The README's "may import" column, by package (``service/wire/`` -> ``service.wire``); "stdlib, numpy"
    and "all of the above" name no package of this project."""
    table: dict[str, set[str]] = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("/`"):
            names = {w.strip("`;,") for w in cells[2].split()}
            table[cells[0].strip("`/").replace("/", ".")] = {n for n in names if n.split(".")[0] in PACKAGES}
    return table


def test_the_readme_table_is_the_one_enforced():
    table = readme_table()
    assert {k: v for k, v in table.items() if k in MAY_IMPORT} == MAY_IMPORT
    assert set(MAY_IMPORT) <= set(table)


def test_the_table_check_sees_an_import_the_table_forbids():
    assert package_of("service.core.errors") == "service.core" and package_of("service.app") == "service"
    assert package_of("service.wire.request") not in MAY_IMPORT["service.core"]


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


def test_only_the_transformers_backend_imports_torch_and_transformers():
    for package in PACKAGES:
        for path, names in top_levels(package).items():
            if names & {"torch", "transformers"}:
                assert path.startswith("service/hf/"), f"{path} imports {sorted(names & {'torch', 'transformers'})}"


def test_ray_is_imported_only_where_the_cluster_is():
    allowed = ("service/cluster/", "service/contexts/directory.py", "service/app.py", "service/serve.py", "workers/actor.py")
    for package in PACKAGES:
        for path, names in top_levels(package).items():
            if "ray" in names:
                assert path.startswith(allowed), f"{path} imports ray"


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
