"""deploy/k8s: the overlays rendered by the small kustomize subset below (resources, namespace, labels, images,
JSON6902 patches: everything deploy/k8s uses), compared with `kubectl kustomize` where kubectl exists, and
validated against the Kubernetes 1.34 JSON schemas that the PyPI package kubernetes-validate bundles; the
probes and the gateway's readiness report.
"""
from __future__ import annotations

import copy
import http.server
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import pytest
import yaml

from tests.deploy.shared import DEPLOY, HEALTH, PROGRESS_FILE, ROOT

pytestmark = pytest.mark.cpu

K8S = DEPLOY / "k8s"
OVERLAYS = ("usp2_fp8", "usp4_bf16", "scale_out")
K8S_VERSION = "1.34.0"  # first release with resource.k8s.io/v1 (DRA) generally available


def _json_pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def _apply_json6902(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = _json_pointer(op["path"])
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] in ("replace", "add") and isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "replace":
                node[index] = op["value"]
            else:
                node.insert(index, op["value"])
        elif op["op"] == "replace":
            if last not in node:
                raise KeyError(f"replace of missing path {op['path']}")
            node[last] = op["value"]
        elif op["op"] == "add":
            node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise ValueError(f"unsupported JSON6902 op {op['op']}")


def _set_images(node, images: list[dict]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                name = value.rsplit(":", 1)[0]
                for image in images:
                    if image["name"] == name:
                        node[key] = f"{image.get('newName', name)}:{image['newTag']}"
            else:
                _set_images(value, images)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, images)


def render(directory: pathlib.Path) -> list[dict]:
    """Render a kustomization with the subset of kustomize that deploy/k8s uses."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}
    assert set(kustomization) <= known, f"renderer does not handle {set(kustomization) - known}"
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, f"patch target {target} matches {len(matches)} resources"
        _apply_json6902(matches[0], yaml.safe_load(patch["patch"]))
    for entry in kustomization.get("labels", []):
        assert not entry.get("includeSelectors"), "renderer only adds metadata labels"
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(entry["pairs"])
    if "namespace" in kustomization:
        for d in docs:
            d["metadata"]["namespace"] = kustomization["namespace"]
    _set_images(docs, kustomization.get("images", []))
    return docs


def _by_key(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _deployment(docs: list[dict]) -> dict:
    return _by_key(docs)[("Deployment", "vitascope")]


@pytest.fixture(scope="module", params=("base", *OVERLAYS))
def rendered(request) -> tuple[str, list[dict]]:
    path = K8S / "base" if request.param == "base" else K8S / "overlays" / request.param
    return request.param, render(path)


def test_manifests_pass_strict_schema_validation(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Ingress", "ResourceClaimTemplate", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_catches_mistakes(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, docs = rendered
    broken = copy.deepcopy(_deployment(docs))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["servce"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = copy.deepcopy(_deployment(docs))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_renderer_agrees_with_kubectl_kustomize(rendered):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the built-in renderer alone is used")
    name, docs = rendered
    path = K8S / "base" if name == "base" else K8S / "overlays" / name
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _by_key(docs) == _by_key([d for d in yaml.safe_load_all(out.stdout) if d])


@pytest.mark.parametrize("overlay, profile", [("usp2_fp8", "usp2_fp8"), ("usp4_bf16", "usp4_bf16"),
                                              ("scale_out", "usp2_fp8")])
def test_overlay_matches_its_profile(overlay, profile):
    from services.common.config import load_profile

    docs = render(K8S / "overlays" / overlay)
    pod = _deployment(docs)["spec"]["template"]["spec"]
    for container in pod["containers"]:  # the stages bind the pod's address: the kubelet probes it, Prometheus too
        scraped = ["--host", "0.0.0.0", "--metrics-host", "0.0.0.0", "--progress-file", PROGRESS_FILE] if (
            container["name"] != "gateway") else []
        assert container["args"] == ["--profile", f"configs/{profile}.yaml", *scraped]
    claim = _by_key(docs)[("ResourceClaimTemplate", "vitascope-gpus")]
    count = claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"]
    assert count == len(load_profile(ROOT / f"configs/{profile}.yaml").dit.devices)


def test_pod_shares_gpus_ipc_and_pids_and_probes_each_stage(rendered):
    _, docs = rendered
    from services.common.grpc_server import SHUTDOWN_GRACE_SECONDS

    pod = _deployment(docs)["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert list(containers) == ["encoder", "dit", "vae", "gateway"]
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "compile-cache")
    for name, (health, port) in HEALTH.items():
        c = containers[name]
        assert c["command"] == ["python", "-m", f"services.{name}"]
        assert c["resources"]["claims"] == [{"name": "gpus"}]  # one shared DRA claim
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "compile-cache", "mountPath": "/cache"} in c["volumeMounts"]  # outlives a restart
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": health}
        assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
        startup = c["startupProbe"]  # an exec probe whose failure message says how far start-up got
        assert c["args"][c["args"].index("--progress-file") + 1] == PROGRESS_FILE
        assert startup["exec"]["command"] == ["python", "-m", "services.common.healthcheck", "--addr",
                                              f"127.0.0.1:{port}", "--service", health, "--progress-file",
                                              PROGRESS_FILE]
        assert startup["timeoutSeconds"] >= 5  # the probe starts a Python interpreter
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # model load + warmup
        assert {"requests", "limits"} <= set(c["resources"])
    gateway = containers["gateway"]
    assert "claims" not in gateway["resources"]
    pre_stop = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_GRACE_SECONDS + pre_stop + 30


def test_gateway_service_is_websocket_friendly(rendered):
    _, docs = rendered
    objects = _by_key(docs)
    service = objects[("Service", "vitascope-gateway")]
    selector = service["spec"]["selector"]
    pod_labels = _deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    annotations = objects[("Ingress", "vitascope")]["metadata"]["annotations"]
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_scale_out_spreads_full_pipelines_and_routes_by_free_slot():
    docs = render(K8S / "overlays" / "scale_out")
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] > 1
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
    gateway = deployment["spec"]["template"]["spec"]["containers"][3]
    assert gateway["env"][0] == {"name": "VITASCOPE_READY_WHEN", "value": "slot"}


class _Healthz(http.server.BaseHTTPRequestHandler):
    report: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's naming
        body = json.dumps(self.report).encode()
        self.send_response(200 if self.report["ok"] else 503)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode, active, queued, ok, ready", [
    ("queue", 0, 0, True, True),
    ("queue", 1, 3, True, True),     # busy, queue has room
    ("queue", 1, 4, True, False),    # queue full
    ("queue", 0, 0, False, False),   # a stage is down
    ("slot", 0, 0, True, True),
    ("slot", 1, 0, True, False),     # busy: send new sessions to another replica
])
def test_gateway_readiness_probe_means_room_for_a_session(mode, active, queued, ok, ready):
    probe = _deployment(render(K8S / "base"))["spec"]["template"]["spec"]["containers"][3]["readinessProbe"]
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    _Healthz.report = {"ok": ok, "sessions_active": active, "sessions_queued": queued, "slots": 1,
                       "queue_limit": 4}
    server = http.server.HTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        script = command[2].replace("127.0.0.1:8000", f"127.0.0.1:{server.server_port}")
        env = {**os.environ, "VITASCOPE_READY_WHEN": mode}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=30)
    finally:
        server.shutdown()
    assert (result.returncode == 0) == ready, result.stderr


def test_gateway_health_report_has_the_keys_the_probe_reads():
    source = (ROOT / "services" / "gateway" / "service.py").read_text()
    for key in ("ok", "sessions_active", "sessions_queued", "slots", "queue_limit"):
        assert f'"{key}"' in source
