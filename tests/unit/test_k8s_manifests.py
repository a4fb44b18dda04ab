"""infra/k8s/ against the vendored schemas (infra/k8s/schemas/): KubeRay's RayCluster / RayJob CRD schemas and
Kubernetes' own definitions for the pods, the Job of the Prefect work pool's template and the volume claim,
strict about unknown fields; the files agree with each other and with the 32B config's layout; a broken copy
of each is refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SCHEMAS = K8S / "schemas"
KINDS = {
    "RayCluster": "kuberay-raycluster-v1.json",
    "RayJob": "kuberay-rayjob-v1.json",
    "PersistentVolumeClaim": "k8s-pod-job.json#/definitions/io.k8s.api.core.v1.PersistentVolumeClaim",
    "Job": "k8s-pod-job.json#/definitions/io.k8s.api.batch.v1.Job",
}


def registry() -> Registry:
    """The vendored schema files, by file name (the `$ref`s between them use those names)."""
    docs = [(p.name, json.loads(p.read_text())) for p in SCHEMAS.glob("*.json")]
    return Registry().with_resources(
        (name, Resource.from_contents(doc, default_specification=DRAFT4)) for name, doc in docs
    )


REGISTRY = registry()


def validator(kind: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator({"$ref": KINDS[kind]}, registry=REGISTRY)


def problems(doc: dict) -> list[str]:
    """Each schema violation of `doc` as `path: message` (empty when it validates)."""
    errors = validator(doc["kind"]).iter_errors(doc)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def rendered_job() -> dict:
    """The work pool's Job manifest as Prefect's worker fills it from the variables' defaults (Prefect's own
    templating; the worker then adds its env entries, which are name/value pairs)."""
    from prefect.utilities.templating import apply_values

    template = json.loads((K8S / "prefect-work-pool.json").read_text())
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    return apply_values(template["job_configuration"]["job_manifest"], defaults)


def test_vendored_schemas_name_their_source_and_license():
    for path in SCHEMAS.glob("*.json"):
        comment = json.loads(path.read_text())["$comment"]
        assert "Apache-2.0" in comment and "commit" in comment and "github.com/" in comment, path.name
        assert path.stat().st_size < 200_000, path.name


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml", "shared-volume.yaml"])
def test_manifests_validate(name):
    assert problems(manifest(name)) == []


def test_prefect_work_pool_template_validates():
    template = json.loads((K8S / "prefect-work-pool.json").read_text())
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    job = rendered_job()
    assert "{{" not in json.dumps(job), "a placeholder without a default"
    assert problems(job) == []
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][0].startswith("ray start --address=dapo-head-svc:6379 --num-cpus=0 --num-gpus=0")
    assert container["args"][0].endswith("&& exec prefect flow-run execute")


def test_files_agree_with_each_other_and_the_recipe():
    from dapo_core.config import load_config, typed

    cluster, job, pvc = manifest("raycluster.yaml"), manifest("rayjob.yaml"), manifest("shared-volume.yaml")
    pool_job = rendered_job()
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    pool_env = {e["name"]: e for e in pool_job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert pool_env["RAY_ADDRESS"]["value"] == f"{cluster['metadata']['name']}-head-svc:6379"
    secret = pool_env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": cluster["spec"]["authOptions"]["secretName"], "key": "auth_token"}
    pods = [cluster["spec"]["headGroupSpec"]["template"]]
    pods += [g["template"] for g in cluster["spec"]["workerGroupSpecs"]] + [pool_job["spec"]["template"]]
    for pod in pods:
        volumes = pod["spec"]["volumes"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v]
        assert claims == [pvc["metadata"]["name"]]
        (c,) = pod["spec"]["containers"]
        assert {"name": "shared", "mountPath": "/shared"} in c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] and env["HF_HUB_OFFLINE"] == "1"
    cfg = typed(load_config(ROOT / "configs" / "dapo_qwen2.5_32b.yaml"))
    (gpu,) = cluster["spec"]["workerGroupSpecs"]
    per_pod = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert (gpu["replicas"], per_pod) == (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node)
    assert gpu["rayStartParams"]["num-gpus"] == str(per_pod)
    assert "--config configs/dapo_qwen2.5_32b.yaml" in job["spec"]["entrypoint"]


def _worker(doc: dict) -> dict[str, Any]:
    return doc["spec"]["workerGroupSpecs"][0]


BROKEN = {
    "worker group without groupName (required by KubeRay)": (
        "raycluster.yaml",
        lambda d: _worker(d).pop("groupName"),
        "'groupName' is a required property",
    ),
    "a misspelt container field (Kubernetes' pod schema)": (
        "raycluster.yaml",
        lambda d: _worker(d)["template"]["spec"]["containers"][0].update(volumeMount=[]),
        "Additional properties are not allowed ('volumeMount' was unexpected)",
    ),
    "replicas as text": (
        "raycluster.yaml",
        lambda d: _worker(d).update(replicas="16"),
        "'16' is not of type 'integer'",
    ),
    "an unknown RayJob field": (
        "rayjob.yaml",
        lambda d: d["spec"].update(entryPoint=d["spec"].pop("entrypoint")),
        "('entryPoint' was unexpected)",
    ),
    "an invalid auth mode": (
        "raycluster.yaml",
        lambda d: d["spec"]["authOptions"].update(mode="password"),
        "'password' is not one of ['disabled', 'token']",
    ),
    "a claim without access modes of the right type": (
        "shared-volume.yaml",
        lambda d: d["spec"].update(accessModes="ReadWriteMany"),
        "'ReadWriteMany' is not of type 'array'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_copies_are_refused(case):
    name, breaks, message = BROKEN[case]
    doc = copy.deepcopy(manifest(name))
    breaks(doc)
    found = problems(doc)
    assert any(message in p for p in found), found
