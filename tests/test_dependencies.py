"""The dependency direction is service -> workers -> merge, and heavy imports stay put."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_top_levels(package: str) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in a package, by file."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_merge_imports_only_the_standard_library_and_numpy():
    import sys

    allowed = set(sys.stdlib_module_names) | {"numpy", "merge"}
    for path, names in imported_top_levels("merge").items():
        assert names <= allowed, f"{path} imports {sorted(names - allowed)}"


@pytest.mark.parametrize("package", ["merge", "workers"])
def test_lower_layers_never_import_the_service(package):
    for path, names in imported_top_levels(package).items():
        assert "service" not in names, f"{path} imports service"


def test_merge_never_imports_workers():
    for path, names in imported_top_levels("merge").items():
        assert "workers" not in names, f"{path} imports workers"


def test_only_the_gpu_backend_imports_cupy():
    for package in ("merge", "workers", "service"):
        for path, names in imported_top_levels(package).items():
            if "cupy" in names:
                assert path == "workers/gpu.py", f"{path} imports cupy"


def test_nothing_imports_tests_or_benchmarks():
    for package in ("merge", "workers", "service"):
        for path, names in imported_top_levels(package).items():
            assert not names & {"tests", "benchmarks"}, path
