"""The KubeRay floor deploy/README.md states (issue 51, point 1): every ``authOptions`` field the manifests
set is in the released CRDs of that version, and the version before it lacks one (the negative control).

Checked against the ``authOptions`` schemas cut from KubeRay's released CRDs (kuberay_auth_options.json
names the files and commits); the whole CRDs are not vendored, so the rest of each manifest is not
checked against them here. Kubernetes prunes a field its structural schema does not know, so an
unknown one is not an error on apply but a setting silently lost: here it is a failure.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = json.loads((Path(__file__).parent / "kuberay_auth_options.json").read_text())["versions"]
MANIFESTS = ("raycluster.yaml", "raycluster-gpu.yaml", "rayservice.yaml")


def stated_floor() -> str:
    [floor] = re.findall(r"Needs the KubeRay operator \*\*(\d+\.\d+\.\d+) or newer\*\*",
                         (ROOT / "deploy" / "README.md").read_text())
    return "v" + floor


def release(tag: str) -> tuple[int, ...]:
    """``v1.6.0`` -> ``(1, 6, 0)``, to compare releases."""
    return tuple(int(part) for part in tag.removeprefix("v").split("."))


def auth_options() -> list[tuple[str, str, dict[str, Any]]]:
    """``(file, kind, authOptions)`` of every Ray object in the manifests."""
    found = []
    for name in MANIFESTS:
        for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / name).read_text()):
            if doc and doc.get("kind") == "RayCluster":
                found.append((name, "RayCluster", doc["spec"]["authOptions"]))
            elif doc and doc.get("kind") == "RayService":
                found.append((name, "RayService", doc["spec"]["rayClusterConfig"]["authOptions"]))
    return found


def problems(options: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """What of ``options`` the schema would prune (unknown fields) or refuse (a value outside its enum or type)."""
    out = []
    types = {"string": str, "boolean": bool}
    for key, value in options.items():
        prop = schema["properties"].get(key)
        if prop is None:
            out.append(f"{key} is not a field of authOptions")
        elif not isinstance(value, types[prop["type"]]) or value not in prop.get("enum", [value]):
            out.append(f"{key}={value!r} is not a valid {prop['type']}")
    return out


def test_every_ray_object_of_the_manifests_sets_its_auth_options():
    found = auth_options()
    assert {(name, kind) for name, kind, _ in found} == {("raycluster.yaml", "RayCluster"),
                                                         ("raycluster-gpu.yaml", "RayCluster"),
                                                         ("rayservice.yaml", "RayService")}
    assert all(options == {"mode": "token", "secretName": "splitkey-ray-auth"} for *_, options in found)


@pytest.mark.parametrize("version", sorted(SCHEMAS))
def test_the_auth_options_hold_from_the_stated_floor_and_not_before(version):
    floor = stated_floor()
    assert floor in SCHEMAS, f"the floor {floor} must be one of the versions checked, {sorted(SCHEMAS)}"
    found = {(name, kind): problems(options, SCHEMAS[version][kind]) for name, kind, options in auth_options()}
    if release(version) >= release(floor):
        assert found == dict.fromkeys(found, []), found
    else:  # the negative control: the release before the floor loses the secret's name
        assert found == dict.fromkeys(found, ["secretName is not a field of authOptions"]), found


def test_every_manifest_states_the_floor_the_readme_does():
    floor = stated_floor().removeprefix("v")
    for name in MANIFESTS:
        header = (ROOT / "deploy" / "k8s" / name).read_text().splitlines()[0]
        assert re.search(rf"KubeRay \(?>= {re.escape(floor)}\b", header), f"{name}: {header}"
