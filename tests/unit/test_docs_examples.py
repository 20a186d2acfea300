"""The examples in README.md and docs/ run, and print what the docs say they print."""

import pathlib
import re
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[2]


def blocks(path: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / path).read_text(), flags=re.DOTALL)


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1
    assert ci[0] in readme, "the README's test command (section Tests) and .ci/run differ"
    assert "Quickstart" in readme


def test_readme_library_example_runs():
    [code] = [b for b in blocks("README.md", "python") if "partial_attention" in b]
    code = code.replace("65536", "4096").replace("30000", "1000")  # same code, smaller arrays
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_quickstart_and_loadtest_doc_commands_are_valid_sweeps():
    from service.cli import build_parser
    from service.client.loadtest.cli import config_from_args

    def sweeps(path: str) -> list:
        lines = [line for b in blocks(path, "bash") for line in b.replace("\\\n", " ").splitlines()
                 if "splitkey loadtest" in line]
        return [config_from_args(build_parser().parse_args(["loadtest", *line.split("splitkey loadtest", 1)[1]
                                                             .split("#")[0].split()])) for line in lines]

    [quickstart] = sweeps("README.md")
    assert quickstart.n_k == (2**20,) and quickstart.shape.dtype == "bfloat16"  # the 1M-key run the README promises
    first, example = sweeps("docs/LOADTEST.md")
    assert first == quickstart
    assert example.modes == ("decode", "prefill", "shared-prefix", "multi-turn") and len(example.points()) == 4


