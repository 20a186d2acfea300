"""Regenerate the vendored KubeRay CRD schemas here from a kuberay git repository.

    python tests/unit/kuberay_crds/vendor.py /path/to/kuberay[.git] v1.5.1 v1.6.0 v1.7.0

For each tag and each of ray.io_rayclusters.yaml / ray.io_rayservices.yaml under
ray-operator/config/crd/bases/, writes ``<tag>/<plural>.json.gz``: the ``openAPIV3Schema`` of the
CRD's ``v1`` version (the served, storage one), as JSON with sorted keys, gzip-compressed without a
timestamp (the same input gives the same bytes); and rewrites SOURCES.json, naming for each file the
repository, tag, commit, path and the sha256 of the YAML it was cut from. Needs git and PyYAML.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPOSITORY = "https://github.com/ray-project/kuberay"
CRDS = {"rayclusters": "ray-operator/config/crd/bases/ray.io_rayclusters.yaml",
        "rayservices": "ray-operator/config/crd/bases/ray.io_rayservices.yaml"}


def git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={git_dir(repo)}", *args], check=True, capture_output=True).stdout


def git_dir(repo: Path) -> Path:
    return repo / ".git" if (repo / ".git").exists() else repo


def v1_schema(crd_yaml: bytes) -> dict[str, Any]:
    crd = yaml.safe_load(crd_yaml)
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"], f"v1 of {crd['metadata']['name']} is not the served storage version"
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def vendor(repo: Path, tags: list[str]) -> dict[str, Any]:
    files = {}
    for tag in tags:
        commit = git(repo, "rev-list", "-n", "1", tag).decode().strip()
        for plural, path in CRDS.items():
            original = git(repo, "show", f"{commit}:{path}")
            data = json.dumps(v1_schema(original), sort_keys=True, separators=(",", ":")).encode()
            out = HERE / tag / f"{plural}.json.gz"
            out.parent.mkdir(exist_ok=True)
            out.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
            files[f"{tag}/{plural}.json.gz"] = {"repository": REPOSITORY, "tag": tag, "commit": commit, "path": path,
                                                "sha256_of_yaml": hashlib.sha256(original).hexdigest()}
    return files


def main(argv: list[str]) -> None:
    repo, *tags = argv
    sources = {
        "what": "The openAPIV3Schema of the v1 version of KubeRay's RayCluster and RayService CRDs, as released "
                "at each tag, for tests/unit/test_deploy_kuberay_floor.py. Each file is that schema as JSON "
                "(sorted keys), gzip-compressed; sha256_of_yaml is of the CRD YAML file at the commit.",
        "how": "python tests/unit/kuberay_crds/vendor.py <kuberay git checkout or bare repository> " + " ".join(tags),
        "files": vendor(Path(repo), tags),
    }
    (HERE / "SOURCES.json").write_text(json.dumps(sources, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
