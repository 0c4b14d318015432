"""deploy/kubernetes/: the example manifests, checked without a cluster (docs/kubernetes.md).

* Every Kubernetes built-in object validates against Kubernetes' own schemas (the JSON schemas the
  ``kubernetes-validate`` package carries, no network), strict: an unknown field fails. Checked for
  the oldest version the docs claim and for the newest the package knows.
* The RayCluster validates against KubeRay's CRD schema (``tests/data/kuberay/``, vendored from
  KubeRay v1.7.0), made strict the way the API server's strict field validation is (a field the
  schema does not name fails); its pod templates validate as Kubernetes PodTemplates, its metadata
  as ObjectMeta. The CRD's CEL rules (``x-kubernetes-validations``) are not evaluated here; the
  KubeRay controller's own checks that concern these manifests are spelled out below.
* What matters to the daemon: liveness on ``/livez``, readiness and start-up on ``/readyz``, on the
  port the daemon listens on; a grace period that covers the preStop sleep, the daemon's drain
  deadline and its stop; every flag of the container's command accepted by the daemon's own parser
  (``supervisor.cli.parse_serve``: vLLM's parser + the supervision group, the ConfigMap's TOML and
  the container's environment resolved as the daemon resolves them) and, on the Ray head, by
  ``ray start``'s; GPUs requested for every rank; a memory-backed ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
MANIFESTS = ("deployment.yaml", "raycluster.yaml")
KUBERAY_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayclusters.v1.schema.yaml"

# The oldest Kubernetes the docs claim, and the newest whose schemas kubernetes-validate carries.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

# What the daemon does after its drain, each step bounded in the code: the engine's shutdown (5 s)
# and the sweep of its rings (10 s: supervisor/builder.py, teardown), the warm standby's stop (30 s:
# supervisor/recovery.py, finish_stop), a last sweep of the rings of workers killed at the stop
# (10 s), uvicorn's graceful shutdown (5 s: supervisor/http.py). Rounded up.
STOP_AFTER_DRAIN_S = 60
# The first engine: weights read, CUDA graphs captured, kernels compiled. At least this long on top
# of waiting for the placement group, before the start-up probe may give up.
MODEL_LOAD_S = 600
GPU = "nvidia.com/gpu"
DAEMON = ("vllm-supervisor", "serve")

# Ray's command-line module (the parser of `ray start`) imports Ray Serve, whose pydantic models warn.
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")


# --- loading -------------------------------------------------------------------------------


def load(name: str) -> list[dict[str, Any]]:
    with open(DEPLOY / name) as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


DOCS = {name: load(name) for name in MANIFESTS}


def one(name: str, kind: str, api_group: str | None = None) -> dict[str, Any]:
    found = [d for d in DOCS[name] if d["kind"] == kind and (api_group is None or d["apiVersion"].startswith(api_group))]
    assert len(found) == 1, f"{name}: expected one {kind}, found {len(found)}"
    return found[0]


def builtin(api_version: str) -> bool:
    """A Kubernetes API (core ``v1``, ``apps/v1``, ``*.k8s.io``), not a custom resource (``ray.io/v1``)."""
    group = api_version.rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def builtin_objects() -> Iterator[Any]:
    for name, docs in DOCS.items():
        for doc in docs:
            if not builtin(doc["apiVersion"]):
                continue  # its CRD's schema, below
            for version in K8S_VERSIONS:
                yield pytest.param(doc, version, id=f"{name}:{doc['kind']}/{doc['metadata']['name']}@{version}")


def command_line(container: dict[str, Any]) -> list[str]:
    """What the container runs: ``command`` + ``args`` (Kubernetes' ENTRYPOINT + CMD)."""
    return [*container.get("command", []), *container.get("args", [])]


def daemon_argv(container: dict[str, Any]) -> list[str]:
    """The ``vllm-supervisor serve`` arguments in the container's command line."""
    argv = command_line(container)
    for i in range(len(argv) - 1):
        if (Path(argv[i]).name, argv[i + 1]) == DAEMON:
            return argv[i + 2:]
    raise AssertionError(f"container {container['name']}: no `vllm-supervisor serve` in {argv}")


def daemon_container(pod: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in pod["containers"] if any((Path(a).name, b) == DAEMON for a, b in zip(command_line(c), command_line(c)[1:]))]
    assert len(found) == 1, f"expected one container running `vllm-supervisor serve`, found {len(found)}"
    return found[0]


def daemon_pods() -> dict[str, tuple[str, dict[str, Any], dict[str, str]]]:
    """manifest -> (file, the daemon's pod spec, the labels its pod carries)."""
    deployment = one("deployment.yaml", "Deployment")
    cluster = one("raycluster.yaml", "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]
    # KubeRay labels the head pod; ray.io/cluster and ray.io/node-type cannot be overridden.
    head_labels = {**head["metadata"].get("labels", {}), "ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    return {"deployment": ("deployment.yaml", deployment["spec"]["template"]["spec"], deployment["spec"]["template"]["metadata"]["labels"]),
            "raycluster-head": ("raycluster.yaml", head["spec"], head_labels)}


PODS = daemon_pods()


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"container {container['name']} has no port named {port!r}"
    return named[0]


def config_file(name: str, pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The text of ``path`` in the container: a key of the ConfigMap (of the same manifest) mounted
    at its directory."""
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts", [])}
    directory, key = os.path.split(path)
    assert directory in mounts, f"{path}: nothing is mounted at {directory}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[directory])
    assert "configMap" in volume, f"{path}: the volume at {directory} is not a ConfigMap"
    configmaps = [d for d in DOCS[name] if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]]
    assert configmaps, f"{path}: ConfigMap {volume['configMap']['name']!r} is not in {name}"
    assert key in configmaps[0]["data"], f"{path}: ConfigMap {volume['configMap']['name']!r} has no key {key!r}"
    return configmaps[0]["data"][key]


def gpus(container: dict[str, Any]) -> int:
    resources = container.get("resources", {})
    limit = resources.get("limits", {}).get(GPU)
    assert limit is not None, f"container {container['name']}: no {GPU} limit"
    request = resources.get("requests", {}).get(GPU, limit)
    assert str(request) == str(limit), f"container {container['name']}: {GPU} request {request} != limit {limit} (Kubernetes requires them equal)"
    return int(limit)


def prestop_sleep_s(container: dict[str, Any]) -> int:
    hook = container.get("lifecycle", {}).get("preStop")
    assert hook, f"container {container['name']}: no preStop hook"
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    argv = hook["exec"]["command"]
    if argv[0].endswith("sh") and argv[1] == "-c":
        argv = shlex.split(argv[2])
    assert Path(argv[0]).name == "sleep" and len(argv) == 2, f"preStop is not a sleep: {argv}"
    return int(argv[1])


# --- the daemon's own parser -------------------------------------------------------------------


class DaemonView:
    """manifest -> (the daemon's resolved settings, vLLM's serve namespace), as the daemon in that
    container would resolve them: its command line, the ConfigMap's TOML behind
    ``--supervisor-config`` and the container's environment (a Secret's value: a placeholder).
    Parsed once per manifest, when a test first asks; a command line the daemon refuses fails the
    tests of that manifest with the daemon's own message."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.done: dict[str, tuple[Any, Any] | str] = {}

    def __getitem__(self, key: str) -> tuple[Any, Any]:
        if key not in self.done:
            self.done[key] = self._parse(key)
        if isinstance(self.done[key], str):
            pytest.fail(self.done[key], pytrace=False)
        return self.done[key]

    def _parse(self, key: str) -> tuple[Any, Any] | str:
        from config import ConfigError
        from supervisor.cli import ServeArgsError, parse_serve

        name, pod, _ = PODS[key]
        container = daemon_container(pod)
        argv = daemon_argv(container)
        assert "--supervisor-config" in argv, f"{name}: the daemon is not given its config file"
        i = argv.index("--supervisor-config") + 1
        toml = self.tmp / f"{key}.toml"
        toml.write_text(config_file(name, pod, container, argv[i]))
        argv = [*argv[:i], str(toml), *argv[i + 1:]]
        env = {e["name"]: e.get("value", f"placeholder-{e['name'].lower()}") for e in container.get("env", [])}
        stderr = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            for var in list(os.environ):
                if var.startswith("VLLM_SUPERVISOR_"):
                    mp.delenv(var)
            for var, value in env.items():
                if var.startswith("VLLM_SUPERVISOR_"):
                    mp.setenv(var, value)
            try:
                with contextlib.redirect_stderr(stderr):
                    return parse_serve(argv)
            except SystemExit:  # vLLM's argparse: the message is on stderr
                return f"{name}: the daemon's parser refuses the command line: {stderr.getvalue().strip().splitlines()[-1]}"
            except (ConfigError, ServeArgsError) as exc:
                return f"{name}: the daemon refuses its configuration: {exc}"


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> DaemonView:
    return DaemonView(tmp_path_factory.mktemp("daemon-config"))


# --- schemas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("doc, version", list(builtin_objects()))
def test_builtin_objects_validate_against_kubernetes_schemas_strict(doc, version):
    k8s_validate(doc, version)


def k8s_validate(doc: dict[str, Any], version: str) -> None:
    """Against Kubernetes' schema of ``version``, strict (an unknown field fails); one line on failure."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(map(str, exc.path)) or "(top)"
        message = f"{doc['kind']}/{doc['metadata']['name']} against Kubernetes {exc.version}: {where}: {exc.message}"
    pytest.fail(message, pytrace=False)  # outside the handler: without the schema dumps of the chained exceptions


def strict_openapi(node: Any) -> Any:
    """An OpenAPI v3 (CRD) schema as a JSON schema that rejects unknown fields: every object
    schema that names its properties gets ``additionalProperties: false`` (unless the CRD keeps
    unknown fields there), as the API server's strict field validation does."""
    if isinstance(node, list):
        return [strict_openapi(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_openapi(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def kuberay_schema() -> dict[str, Any]:
    text = KUBERAY_SCHEMA.read_text()
    assert "commit 59d663aeec13760646da3db9c1cf8cfe883e30b7" in text and "Apache-2.0" in text  # the provenance header
    return strict_openapi(json.loads("".join(line for line in text.splitlines(True) if not line.startswith("#"))))


def test_raycluster_validates_against_kuberay_crd_schema_strict(kuberay_schema):
    cluster = one("raycluster.yaml", "RayCluster", "ray.io/")
    assert cluster["apiVersion"] == "ray.io/v1"
    validator = jsonschema.Draft7Validator(kuberay_schema)
    errors = sorted(validator.iter_errors(cluster), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    # What the CRD leaves open: its metadata (ObjectMeta) and, to be sure, the pod templates as
    # Kubernetes' own PodTemplate.
    for version in K8S_VERSIONS:
        k8s_validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": cluster["metadata"]}, version)
        groups = [("head", cluster["spec"]["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["spec"]["workerGroupSpecs"]]
        for group, spec in groups:
            k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": spec["template"]}, version)


def test_strict_crd_schema_rejects_an_unknown_field(kuberay_schema):
    """The check above can fail: a misspelt field of the RayCluster is found."""
    cluster = json.loads(json.dumps(one("raycluster.yaml", "RayCluster")))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 1
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    messages = [e.message for e in jsonschema.Draft7Validator(kuberay_schema).iter_errors(cluster)]
    assert any("'maxReplica' was unexpected" in m for m in messages), messages
    assert any("'livenesProbe' was unexpected" in m for m in messages), messages


def test_raycluster_passes_the_kuberay_controllers_own_checks():
    """The rules KubeRay's controller applies (ray-operator/controllers/ray/utils/validation.go,
    v1.7.0) that concern this manifest, and the token Secret it creates."""
    cluster = one("raycluster.yaml", "RayCluster")
    name, spec = cluster["metadata"]["name"], cluster["spec"]
    assert len(name) <= 53 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name  # DNS-1035, MaxRayClusterNameLength
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"], group["groupName"]
    if spec.get("authOptions", {}).get("mode") == "token":
        assert tuple(map(int, spec["rayVersion"].split(".")[:2])) >= (2, 52), "token auth needs Ray >= 2.52"
        # KubeRay's token Secret is named after the cluster, and an existing Secret of that name is
        # taken as the token's: none of ours may have it.
        token_secret = spec["authOptions"].get("secretName") or name
        ours = {e["valueFrom"]["secretKeyRef"]["name"] for docs in DOCS.values() for d in docs for c in _containers(d)
                for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
        assert token_secret not in ours, f"KubeRay's token Secret {token_secret!r} is also one of ours"
    # The Ray in the image is the one the daemon pins.
    import tomllib

    pins = [r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"] if r.startswith("ray==")]
    assert pins == [f"ray=={spec['rayVersion']}"], (pins, spec["rayVersion"])


def _containers(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if doc["kind"] == "Deployment":
        yield from doc["spec"]["template"]["spec"]["containers"]
    elif doc["kind"] == "RayCluster":
        yield from doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        for group in doc["spec"]["workerGroupSpecs"]:
            yield from group["template"]["spec"]["containers"]


# --- what the daemon needs ---------------------------------------------------------------------


@pytest.mark.parametrize("key", PODS)
def test_probes_liveness_livez_readiness_readyz_on_the_daemons_port(key, parsed):
    _, pod, _ = PODS[key]
    container = daemon_container(pod)
    _, ns = parsed[key]
    probes = {kind: container.get(kind) for kind in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert all(probes.values()), f"{key}: missing {[k for k, v in probes.items() if not v]}"
    # /livez is 200 while the daemon recovers; /readyz is 503 then. A liveness probe on /readyz would
    # have the kubelet kill the daemon in the middle of every recovery.
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez", "liveness must be /livez (a recovery must not get the pod killed)"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert probes["startupProbe"]["httpGet"]["path"] == "/readyz"
    for kind, probe in probes.items():
        port = container_port(container, probe["httpGet"]["port"])
        assert port == ns.port, f"{key}: {kind} probes port {port}, the daemon listens on --port {ns.port}"
        assert probe["httpGet"].get("scheme", "HTTP") == ("HTTPS" if ns.ssl_certfile else "HTTP"), kind
        if kind != "readinessProbe":
            assert probe.get("successThreshold", 1) == 1, f"{kind}: Kubernetes requires successThreshold 1"
    assert ns.host == "0.0.0.0", f"{key}: the daemon listens on {ns.host}: the kubelet and the Service cannot reach it"
    assert ns.port in [p["containerPort"] for p in container["ports"]], f"{key}: --port {ns.port} is not a container port"


@pytest.mark.parametrize("key", PODS)
def test_startup_probe_covers_placement_and_model_load(key, parsed):
    _, pod, _ = PODS[key]
    probe = daemon_container(pod)["startupProbe"]
    settings, _ = parsed[key]
    budget = probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
    # With an existing cluster the first placement group may wait for worker pods: placement_timeout_s.
    needed = (settings.ray.placement_timeout_s if settings.ray.address else 0) + MODEL_LOAD_S
    assert budget >= needed, f"{key}: start-up probe allows {budget} s; placement + model load may take {needed:g} s"


@pytest.mark.parametrize("key", PODS)
def test_grace_period_covers_prestop_drain_and_stop(key, parsed):
    from config.settings import SupervisorSettings

    _, pod, _ = PODS[key]
    settings, _ = parsed[key]
    drain = settings.supervisor.drain_timeout_s  # the daemon's own resolution: its default unless the manifest sets it
    default = SupervisorSettings.model_fields["drain_timeout_s"].default
    grace = pod.get("terminationGracePeriodSeconds", 30)
    sleep = prestop_sleep_s(daemon_container(pod))
    needed = sleep + drain + STOP_AFTER_DRAIN_S
    assert grace >= needed, (f"{key}: terminationGracePeriodSeconds {grace} < preStop sleep {sleep} + drain_timeout_s {drain:g} "
                             f"(default {default:g}) + stop {STOP_AFTER_DRAIN_S}")


@pytest.mark.parametrize("key", PODS)
def test_the_daemons_parser_accepts_the_command(key, parsed):
    """``parsed`` ran the daemon's parser on the container's command line; here, what it made of it."""
    name, pod, _ = PODS[key]
    settings, ns = parsed[key]
    assert ns.model and not ns.model.startswith("-"), f"{key}: no model: the daemon would serve its demo model"
    assert ns.distributed_executor_backend == "ray"
    assert settings.supervisor.data_dir.is_absolute()
    mounts = [m["mountPath"] for m in daemon_container(pod)["volumeMounts"]]
    assert str(settings.supervisor.data_dir) in mounts, f"{key}: data_dir {settings.supervisor.data_dir} is not a volume"
    if key == "deployment":
        assert settings.ray.address == "", "one pod: the daemon starts its own Ray cluster"
    else:
        host, _, port = settings.ray.address.rpartition(":")
        assert host in ("127.0.0.1", "localhost"), f"the daemon joins the head in its own container, not {settings.ray.address}"
        assert int(port) == ray_head_port(), "the daemon's --ray-address is not the head's GCS port"


def ray_start_argv() -> list[str]:
    """The head container's ``ray start`` line, and a check of the script around it."""
    head = daemon_container(PODS["raycluster-head"][1])
    command = head["command"]
    assert command[:2] == ["/bin/bash", "-c"] and len(command) == 4, "command: bash -c SCRIPT NAME (the args are $1...)"
    lines = [line.strip() for line in command[2].strip().splitlines()]
    assert lines[-1] == 'exec "$@"', "the script must end by exec'ing the daemon (the args): it receives the pod's SIGTERM"
    assert "set -e" in lines, "a failed `ray start` must stop the container"
    starts = [shlex.split(line) for line in lines if line.startswith("ray start")]
    assert len(starts) == 1, lines
    return starts[0][2:]


def ray_head_port() -> int:
    from ray.scripts.scripts import start

    params = start.make_context("ray start", ray_start_argv()).params  # Ray's own parser: an unknown flag raises
    return params["port"]


def test_ray_head_command_is_what_kuberay_and_the_daemon_expect():
    from ray.scripts.scripts import start

    cluster = one("raycluster.yaml", "RayCluster")
    head_spec = cluster["spec"]["headGroupSpec"]
    head = daemon_container(head_spec["template"]["spec"])
    assert cluster["metadata"]["annotations"].get("ray.io/overwrite-container-cmd") == "true", \
        "without it KubeRay replaces the command with its own `ray start --block`"
    params = start.make_context("ray start", ray_start_argv()).params
    assert params["head"] and not params["block"], "the head must start without --block, then the daemon runs"
    # Workers join at KubeRay's head port (rayStartParams' port, else 6379) through the head
    # Service, whose ports are the container's when it lists any.
    assert params["port"] == int(head_spec.get("rayStartParams", {}).get("port", 6379))
    assert container_port(head, "gcs-server") == params["port"], "the head container must declare the GCS port (gcs-server)"
    assert params["num_gpus"] == gpus(head), "ray start --num-gpus must be the container's GPUs"


@pytest.mark.parametrize("key", PODS)
def test_gpus_requested_for_every_rank(key, parsed):
    _, pod, _ = PODS[key]
    settings, ns = parsed[key]
    ranks = ns.tensor_parallel_size * ns.pipeline_parallel_size * settings.supervisor.replicas
    total = gpus(daemon_container(pod))
    if key == "raycluster-head":
        for group in one("raycluster.yaml", "RayCluster")["spec"]["workerGroupSpecs"]:
            per_pod = sum(gpus(c) for c in group["template"]["spec"]["containers"][:1])  # KubeRay's Ray container is the first
            total += per_pod * group.get("numOfHosts", 1) * group["minReplicas"]
    assert total >= ranks, f"{key}: {total} GPUs for {ranks} ranks (TP {ns.tensor_parallel_size} x PP {ns.pipeline_parallel_size} x replicas)"


def vllm_pods() -> Iterator[Any]:
    yield pytest.param(PODS["deployment"][1], id="deployment")
    cluster = one("raycluster.yaml", "RayCluster")
    yield pytest.param(cluster["spec"]["headGroupSpec"]["template"]["spec"], id="raycluster-head")
    for group in cluster["spec"]["workerGroupSpecs"]:
        yield pytest.param(group["template"]["spec"], id=f"raycluster-{group['groupName']}")


@pytest.mark.parametrize("pod", list(vllm_pods()))
def test_pods_have_memory_backed_dev_shm_and_no_service_links(pod):
    container = pod["containers"][0]
    shm = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    assert shm, "no /dev/shm mount: a container's own is 64 MiB"
    volume = next(v for v in pod["volumes"] if v["name"] == shm[0])
    assert volume.get("emptyDir", {}).get("medium") == "Memory", "/dev/shm must be a memory-backed emptyDir"
    # Service links would put VLLM_PORT=tcp://... in the environment for a Service named `vllm`.
    assert pod.get("enableServiceLinks") is False
    gpus(container)


@pytest.mark.parametrize("name", MANIFESTS)
def test_services_select_the_daemons_pod_and_port(name, parsed):
    key = {"deployment.yaml": "deployment", "raycluster.yaml": "raycluster-head"}[name]
    _, pod, labels = PODS[key]
    container = daemon_container(pod)
    _, ns = parsed[key]
    if name == "deployment.yaml":
        selector = one(name, "Deployment")["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), "the Deployment's selector does not match its pods"
    service = one(name, "Service")
    assert service["spec"]["selector"].items() <= labels.items(), f"Service {service['metadata']['name']} selects no daemon pod"
    for port in service["spec"]["ports"]:
        target = container_port(container, port.get("targetPort", port["port"]))
        assert target == ns.port, f"Service port {port['port']} goes to {target}, the daemon listens on {ns.port}"
    assert all(d["metadata"]["name"] != "vllm" for d in DOCS[name] if d["kind"] == "Service")
