"""Write the schema files that `tests/unit/test_k8s_manifests.py` validates infra/k8s/ against, from a KubeRay
checkout and the Kubernetes OpenAPI (v2) document that kubernetes-client/python ships:

    python infra/k8s/schemas/vendor_schemas.py KUBERAY_DIR KUBERAY_COMMIT SWAGGER_JSON K8S_SOURCE

What it keeps (each output file's `$comment` says the same, with the sources):
- `kuberay-<kind>-v1.json`: the `v1` openAPIV3Schema of KubeRay's RayCluster and RayJob CRDs, strict (an
  object with `properties` and nothing else allowed gets `additionalProperties: false`, as `kubectl apply
  --validate=strict` refuses unknown fields), each embedded pod template replaced by a `$ref` to Kubernetes'
  own PodTemplateSpec, and descriptions dropped.
- `k8s-pod-job.json`: Kubernetes' definitions reachable from PodTemplateSpec, Job and Secret / PVC, strict the
  same way; `Quantity` and `IntOrString` accept numbers as the API server does; descriptions dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
K8S_FILE = "k8s-pod-job.json"
POD_TEMPLATE = "io.k8s.api.core.v1.PodTemplateSpec"
ROOTS = [POD_TEMPLATE, "io.k8s.api.batch.v1.Job", "io.k8s.api.core.v1.Secret"]
ROOTS += ["io.k8s.api.core.v1.PersistentVolumeClaim"]
NUMERIC = {
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"anyOf": [{"type": "string"}, {"type": "number"}]},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
}


def strict(node: Any) -> Any:
    """`node` without descriptions, every closed object (properties, no additionalProperties, no
    x-kubernetes-preserve-unknown-fields) made strict."""
    if isinstance(node, list):
        return [strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if k != "description"}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def pod_templates_to_ref(node: Any, path: str = "") -> Any:
    """`node` with each embedded PodTemplateSpec (an object whose properties are exactly metadata and spec,
    with spec.containers) replaced by a `$ref` to Kubernetes' definition."""
    if isinstance(node, list):
        return [pod_templates_to_ref(x, path) for x in node]
    if not isinstance(node, dict):
        return node
    props = node.get("properties", {})
    if set(props) == {"metadata", "spec"} and "containers" in props["spec"].get("properties", {}):
        return {"$ref": f"{K8S_FILE}#/definitions/{POD_TEMPLATE}"}
    return {k: pod_templates_to_ref(v, f"{path}/{k}") for k, v in node.items()}


def crd_schema(crd_file: Path) -> dict:
    """The strict `v1` schema of a CRD file, pod templates by reference."""
    crd = yaml.load(crd_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(pod_templates_to_ref(v1["schema"]["openAPIV3Schema"]))
    schema.pop("additionalProperties", None)  # apiVersion/kind/metadata/spec/status; status is the operator's
    return schema


def k8s_definitions(swagger: dict) -> dict:
    """The definitions reachable from ROOTS, strict, with NUMERIC's replacements."""
    defs = swagger["definitions"]
    keep: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = NUMERIC.get(name) or strict(defs[name])
        todo += [r.rsplit("/", 1)[1] for r in refs(keep[name])]
    return dict(sorted(keep.items()))


def refs(node: Any) -> list[str]:
    """Every `$ref` string inside `node`."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for x in node for r in refs(x)]
    return []


def write(path: Path, comment: str, body: dict) -> None:
    path.write_text(json.dumps({"$comment": comment, **body}, sort_keys=False, separators=(",", ":")) + "\n")
    print(f"{path.relative_to(HERE.parents[2])}: {path.stat().st_size // 1024} kB")


def main(kuberay: str, commit: str, swagger_json: str, k8s_source: str) -> None:
    license_note = "License: Apache-2.0 (the source's LICENSE); data vendored by vendor_schemas.py."
    for kind, crd in (("raycluster", "rayclusters"), ("rayjob", "rayjobs")):
        src = f"ray-operator/config/crd/bases/ray.io_{crd}.yaml"
        comment = (
            f"KubeRay {kind} CRD, version v1: spec.versions[v1].schema.openAPIV3Schema of "
            f"github.com/ray-project/kuberay {src} at commit {commit}. Changed: descriptions dropped; "
            "closed objects strict (additionalProperties false); pod templates as $ref to "
            f"{K8S_FILE}. {license_note}"
        )
        write(HERE / f"kuberay-{kind}-v1.json", comment, crd_schema(Path(kuberay) / src))
    comment = (
        f"Kubernetes definitions reachable from {', '.join(ROOTS)}, from {k8s_source}. Changed: descriptions "
        "dropped; closed objects strict (additionalProperties false); Quantity and IntOrString also accept "
        f"numbers. {license_note}"
    )
    swagger = json.loads(Path(swagger_json).read_text())
    write(HERE / K8S_FILE, comment, {"definitions": k8s_definitions(swagger)})


if __name__ == "__main__":
    main(*sys.argv[1:])
