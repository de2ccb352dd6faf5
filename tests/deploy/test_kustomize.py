"""Every kustomization renders, and every object it renders passes a schema:
Kubernetes' own (kubernetes-validate, strict) for built-in kinds, a vendored
subset for the CRDs (tests/deploy/schemas/)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .manifests import K8S, KUSTOMIZATIONS, pod_templates, render

# A release most clusters run today, and the newest the installed
# kubernetes-validate knows (catches removed APIs early).
K8S_VERSIONS = sorted({"1.33.0", kubernetes_validate.utils.latest_version()})

SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    (s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"]): s
    for s in (json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json")))
}
EXPECTED_KUSTOMIZATIONS = {"base", "cpu", "gpu", "multinode", "multinode-statefulset"}


def validate(obj: dict, version: str) -> None:
    """Raises on an invalid object; fails on a kind no schema covers."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).validate(obj)
        # Pod templates inside custom resources get the full Kubernetes schema.
        for role, template in pod_templates(obj):
            wrapper = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{obj['metadata']['name']}-{role}"}, "template": template}
            kubernetes_validate.validate(wrapper, version, strict=True)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"no schema for {key}: vendor one under tests/deploy/schemas/", pytrace=False)


def test_all_kustomizations_are_tested() -> None:
    assert set(KUSTOMIZATIONS) == EXPECTED_KUSTOMIZATIONS


def test_every_component_is_used_by_an_overlay() -> None:
    components = {p.parent.name for p in (K8S / "components").glob("*/kustomization.yaml")}
    used = set()
    for path in (K8S / "overlays").glob("*/kustomization.yaml"):
        used |= {Path(c).name for c in yaml.safe_load(path.read_text()).get("components", [])}
    assert components and components <= used, f"never rendered: {components - used}"


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_renders_to_named_objects(name: str) -> None:
    docs = render(name)
    assert docs
    keys = [(d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"duplicate objects in {name}"
    if name != "base":
        assert {d["metadata"].get("namespace") for d in docs} == {"kvsentry"}, "an object misses the namespace"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_objects_match_schemas(name: str, version: str) -> None:
    problems = []
    for obj in render(name):
        try:
            validate(obj, version)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {list(e.absolute_path)}: {e.message}")
    assert not problems, "\n".join(problems)


def test_renderings_cover_the_crds() -> None:
    rendered = {(d["apiVersion"], d["kind"]) for name in KUSTOMIZATIONS for d in render(name)}
    assert set(CRD_SCHEMAS) <= rendered, f"schemas for kinds no manifest uses: {set(CRD_SCHEMAS) - rendered}"


# The validators above could pass everything; show that they catch a typo.

def _first(name: str, kind: str) -> dict:
    return copy.deepcopy(next(d for d in render(name) if d["kind"] == kind))


@pytest.mark.parametrize("name,kind", [("cpu", "Deployment"), ("gpu", "ServiceMonitor"),
                                       ("gpu", "PrometheusRule"), ("multinode", "LeaderWorkerSet")])
def test_validation_rejects_a_misspelt_field(name: str, kind: str) -> None:
    obj = _first(name, kind)
    if kind == "LeaderWorkerSet":
        target = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    elif kind == "Deployment":
        target = obj["spec"]["template"]["spec"]["containers"][0]
    elif kind == "ServiceMonitor":
        target = obj["spec"]["endpoints"][0]
    else:
        target = obj["spec"]["groups"][0]["rules"][0]
    target["imagePullPolicyy" if "image" in target else "intervall"] = "x"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj, K8S_VERSIONS[0])


def test_validation_rejects_a_missing_required_field() -> None:
    lws = _first("multinode", "LeaderWorkerSet")
    del lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    with pytest.raises(jsonschema.ValidationError):
        validate(lws, K8S_VERSIONS[0])
