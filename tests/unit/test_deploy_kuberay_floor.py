"""The KubeRay floor deploy/README.md states (issue 51, point 1), proven against KubeRay's released CRDs.

Every Ray object of the manifests (RayCluster in raycluster.yaml and raycluster-gpu.yaml, RayService in
rayservice.yaml) is validated against the whole ``openAPIV3Schema`` of the ``v1`` version of the
RayCluster/RayService CRD of each vendored release (tests/unit/kuberay_crds; SOURCES.json names each file's
repository, tag, commit, path and the sha256 of the YAML it was cut from; vendor.py regenerates them): the
stated floor and the newest release take every manifest with no problem, and the release before the floor
reports exactly the field that sets the floor, ``authOptions.secretName`` (the negative control). Copies of
the manifests with a misspelled field or a wrong type show the check catches those too, naming the path.

The API server's checks of a structural schema are emulated with ``jsonschema`` (``structural``): a field the
schema does not know is pruned on apply, a setting silently lost, so here it is a problem; see there for what
is and is not emulated.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).parent / "kuberay_crds"
SOURCES = json.loads((CRDS / "SOURCES.json").read_text())["files"]
MANIFESTS = ("raycluster.yaml", "raycluster-gpu.yaml", "rayservice.yaml")
PLURAL = {"RayCluster": "rayclusters", "RayService": "rayservices"}
# Where each kind's RayCluster spec is, as a path prefix of problems.
CLUSTER_SPEC = {"RayCluster": "spec.", "RayService": "spec.rayClusterConfig."}


def release(tag: str) -> tuple[int, ...]:
    """``v1.6.0`` -> ``(1, 6, 0)``, to compare releases."""
    return tuple(int(part) for part in tag.removeprefix("v").split("."))


VERSIONS = sorted({source["tag"] for source in SOURCES.values()}, key=release)


def stated_floor() -> str:
    [floor] = re.findall(r"Needs the KubeRay operator \*\*(\d+\.\d+\.\d+) or newer\*\*",
                         (ROOT / "deploy" / "README.md").read_text())
    return "v" + floor


def structural(schema: dict[str, Any], root: bool = True) -> dict[str, Any]:
    """A CRD's structural ``openAPIV3Schema`` as a Draft 7 JSON Schema that refuses what the API server refuses
    or prunes.

    * A field an object's schema does not name (it has no ``additionalProperties`` and no
      ``x-kubernetes-preserve-unknown-fields: true``) is refused: the API server would prune it.
    * ``x-kubernetes-int-or-string: true`` takes an integer or a string; ``nullable: true`` takes null too.
    * A ``required`` field with a ``default`` may be left out: defaulting comes before validation.
    * The object's own ``metadata`` is left loose: the API server checks it as ObjectMeta, not by the schema
      (its schema is a bare ``type: object``). The ``metadata`` of pod templates is a field like any other.
    * ``type``, ``enum``, ``pattern``, ``maxLength``, ``minimum``, ``items`` ... are checked as written.
    * Not emulated: ``format`` (int32, int64, date-time: annotations to jsonschema) and the CEL rules of
      ``x-kubernetes-validations``, which ``test_no_manifest_sets_a_field_under_a_cel_rule`` keeps off the
      manifests' fields.
    """
    out = {key: value for key, value in schema.items()
           if not key.startswith("x-kubernetes-") and key not in ("nullable", "format", "default")}
    if "properties" in schema:
        out["properties"] = {name: structural(sub, root=False) for name, sub in schema["properties"].items()}
        if root:
            out["properties"]["metadata"] = {"type": "object"}
        defaulted = {name for name, sub in schema["properties"].items() if "default" in sub}
        if "required" in schema:
            out["required"] = [name for name in schema["required"] if name not in defaulted]
    if isinstance(schema.get("items"), dict):
        out["items"] = structural(schema["items"], root=False)
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"], root=False)
    if "anyOf" in schema:
        out["anyOf"] = [structural(sub, root=False) for sub in schema["anyOf"]]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    elif schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (schema.get("type") == "object" and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def validator(version: str, kind: str) -> jsonschema.Draft7Validator:
    raw = json.loads(gzip.decompress((CRDS / version / f"{PLURAL[kind]}.json.gz").read_bytes()))
    schema = structural(raw)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def dotted(path: Iterable[Any]) -> str:
    """``['spec', 'workerGroupSpecs', 0, 'replicas']`` -> ``spec.workerGroupSpecs[0].replicas``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.removeprefix(".")


def problems(obj: dict[str, Any], version: str) -> list[str]:
    """What the API server would refuse or prune of ``obj`` under ``version``'s CRD, each naming its path."""
    found = []
    for error in validator(version, obj["kind"]).iter_errors(obj):
        where = dotted(error.absolute_path)
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            found += [f"{dotted([*error.absolute_path, key])}: not a field of the {version} CRD (pruned)"
                      for key in error.instance if key not in known]
        else:
            found.append(f"{where or '(the object)'}: {error.message}")
    return sorted(found)


def ray_objects() -> list[tuple[str, dict[str, Any]]]:
    """``(file, object)`` of every Ray object (RayCluster, RayService) in the manifests."""
    return [(name, doc) for name in MANIFESTS
            for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / name).read_text())
            if doc and doc.get("kind") in PLURAL]


def one(name: str) -> dict[str, Any]:
    """A copy of the one Ray object of a manifest."""
    [obj] = [obj for file, obj in ray_objects() if file == name]
    return copy.deepcopy(obj)


def test_the_vendored_crds_are_the_files_sources_json_names_for_each_version():
    on_disk = {str(path.relative_to(CRDS)) for path in CRDS.rglob("*.json.gz")}
    assert on_disk == set(SOURCES)
    assert on_disk == {f"{version}/{plural}.json.gz" for version in VERSIONS for plural in PLURAL.values()}
    for file, source in SOURCES.items():
        assert file.startswith(source["tag"] + "/"), file
        assert source["repository"] == "https://github.com/ray-project/kuberay", file
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and re.fullmatch(r"[0-9a-f]{64}", source["sha256_of_yaml"])
        assert source["path"] == f"ray-operator/config/crd/bases/ray.io_{file.split('/')[1].removesuffix('.json.gz')}.yaml"


def test_the_stated_floor_is_vendored_with_a_release_before_it_and_one_after_it():
    floor = stated_floor()
    assert floor in VERSIONS, f"the floor {floor} must be one of the versions checked, {VERSIONS}"
    assert VERSIONS[0] != floor, "no release before the floor: no negative control"
    assert VERSIONS[-1] != floor, "the newest release vendored is the floor: vendor the newest too"


def test_every_ray_object_of_the_manifests_is_a_v1_object_that_sets_its_auth_options():
    found = ray_objects()
    assert [(name, obj["kind"]) for name, obj in found] == [("raycluster.yaml", "RayCluster"),
                                                            ("raycluster-gpu.yaml", "RayCluster"),
                                                            ("rayservice.yaml", "RayService")]
    assert all(obj["apiVersion"] == "ray.io/v1" for _, obj in found)
    spec = {"RayCluster": lambda obj: obj["spec"], "RayService": lambda obj: obj["spec"]["rayClusterConfig"]}
    assert all(spec[obj["kind"]](obj)["authOptions"] == {"mode": "token", "secretName": "splitkey-ray-auth"}
               for _, obj in found)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_manifests_validate_against_the_whole_crds_from_the_stated_floor_and_not_before(version):
    found = {name: problems(obj, version) for name, obj in ray_objects()}
    if release(version) >= release(stated_floor()):
        assert found == {name: [] for name in found}, found
    else:  # the negative control: the release before the floor drops the secret's name, and only that
        lost = f"authOptions.secretName: not a field of the {version} CRD (pruned)"
        assert found == {name: [CLUSTER_SPEC[obj["kind"]] + lost] for name, obj in ray_objects()}, found


def rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


# (manifest, what is broken, the change, the problem expected on the floor and the newest release)
MUTATIONS: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("raycluster.yaml", "workerGroupSpecs misspelled",
     lambda obj: rename(obj["spec"], "workerGroupSpecs", "workerGroupSpec"),
     "spec.workerGroupSpec: not a field of the {version} CRD (pruned)"),
    ("raycluster-gpu.yaml", "a container's resources misspelled",
     lambda obj: rename(obj["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0], "resources", "resource"),
     "spec.workerGroupSpecs[0].template.spec.containers[0].resource: not a field of the {version} CRD (pruned)"),
    ("rayservice.yaml", "a pod template's metadata field misspelled",
     lambda obj: rename(obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"], "labels", "label"),
     "spec.rayClusterConfig.headGroupSpec.template.metadata.label: not a field of the {version} CRD (pruned)"),
    ("raycluster.yaml", "replicas a word",
     lambda obj: obj["spec"]["workerGroupSpecs"][0].__setitem__("replicas", "two"),
     "spec.workerGroupSpecs[0].replicas: 'two' is not of type 'integer'"),
    ("rayservice.yaml", "a rayStartParams value a number, not a string",
     lambda obj: obj["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0),
     "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'"),
    ("raycluster.yaml", "the head group left out",
     lambda obj: obj["spec"].pop("headGroupSpec"),
     "spec: 'headGroupSpec' is a required property"),
    ("raycluster-gpu.yaml", "a container port's number a name (int-or-string is not everywhere)",
     lambda obj: obj["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0].__setitem__(
         "containerPort", "gcs"),
     "spec.headGroupSpec.template.spec.containers[0].ports[0].containerPort: 'gcs' is not of type 'integer'"),
]


@pytest.mark.parametrize("version", [pytest.param("floor"), pytest.param("newest")])
@pytest.mark.parametrize(("name", "broken", "mutate", "expected"), MUTATIONS, ids=[m[1] for m in MUTATIONS])
def test_a_misspelled_field_or_a_wrong_type_in_a_manifest_is_caught_naming_its_path(version, name, broken, mutate,
                                                                                   expected):
    tag = stated_floor() if version == "floor" else VERSIONS[-1]
    obj = one(name)
    assert problems(obj, tag) == []
    mutate(obj)
    assert problems(obj, tag) == [expected.format(version=tag)], broken


def test_int_or_string_fields_take_an_int_or_a_string_and_nothing_else():
    obj = one("raycluster.yaml")
    probe = obj["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    for value in (8000, "http"):
        probe["readinessProbe"] = {"httpGet": {"path": "/", "port": value}}
        assert problems(obj, VERSIONS[-1]) == [], value
    probe["readinessProbe"] = {"httpGet": {"path": "/", "port": [8000]}}
    [problem] = problems(obj, VERSIONS[-1])
    assert problem.startswith("spec.headGroupSpec.template.spec.containers[0].readinessProbe.httpGet.port: [8000] is not valid")


def cel_rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path (``[]`` for a list's items, ``{}`` for a map's values) of every schema with CEL rules."""
    if "x-kubernetes-validations" in schema:
        yield path
    for name, sub in schema.get("properties", {}).items():
        yield from cel_rules(sub, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from cel_rules(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from cel_rules(schema["additionalProperties"], (*path, "{}"))


def sets(obj: Any, path: tuple[str, ...]) -> bool:
    """Whether ``obj`` has a value at ``path`` (``[]``/``{}``: any item/value)."""
    if not path:
        return True
    head, *rest = path
    if head in ("[]", "{}"):
        values = obj if isinstance(obj, list) else obj.values() if isinstance(obj, dict) else []
        return any(sets(value, tuple(rest)) for value in values)
    return isinstance(obj, dict) and head in obj and sets(obj[head], tuple(rest))


@pytest.mark.parametrize("version", VERSIONS)
def test_no_manifest_sets_a_field_under_a_cel_rule(version):
    """The CEL rules (x-kubernetes-validations) are not evaluated here: there are a few (managedBy,
    gcsFaultToleranceOptions.backend), and no manifest sets the fields they are on."""
    for name, obj in ray_objects():
        raw = json.loads(gzip.decompress((CRDS / version / f"{PLURAL[obj['kind']]}.json.gz").read_bytes()))
        rules = list(cel_rules(raw))
        assert rules, "the vendored schemas have CEL rules: this test must find them"
        assert [rule for rule in rules if sets(obj, rule)] == [], name


def test_every_manifest_states_the_floor_the_readme_does():
    floor = stated_floor().removeprefix("v")
    for name in MANIFESTS:
        header = (ROOT / "deploy" / "k8s" / name).read_text().splitlines()[0]
        assert re.search(rf"KubeRay \(?>= {re.escape(floor)}\b", header), f"{name}: {header}"
