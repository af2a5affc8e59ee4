"""deploy/: compose files, Kubernetes manifests, Grafana dashboard and their agreement with the code.

Compose is checked with `docker compose config` (plugin) or `docker-compose config` (Debian package
`docker-compose`), whichever is installed. Kubernetes overlays are rendered by the small kustomize subset
below (resources, namespace, labels, images, JSON6902 patches: everything deploy/k8s uses), compared with
`kubectl kustomize` where kubectl exists, and validated against the Kubernetes 1.34 JSON schemas that the
PyPI package kubernetes-validate bundles.
"""
from __future__ import annotations

import copy
import http.server
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import pytest
import yaml

pytestmark = pytest.mark.cpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("usp2_fp8", "usp4_bf16", "scale_out")
K8S_VERSION = "1.34.0"  # first release with resource.k8s.io/v1 (DRA) generally available
HEALTH = {"encoder": ("vitascope.encoder.v1.Encoder", 50051), "dit": ("vitascope.dit.v1.DiT", 50052),
          "vae": ("vitascope.vae.v1.VAE", 50053)}
METRICS = {
    "vitascope_time_to_first_chunk_seconds": "histogram",
    "vitascope_chunk_interval_seconds": "histogram",
    "vitascope_stage_latency_seconds": "histogram",
    "vitascope_active_sessions": "gauge",
    "vitascope_queued_sessions": "gauge",
    "vitascope_transport_fallbacks_total": "counter",
    "vitascope_gpu_memory_bytes": "gauge",
}


# --- docker compose ----------------------------------------------------------------------------------------


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def _compose_config(files: list[str], env_file: str | None) -> subprocess.CompletedProcess:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    args = [*cli]
    for f in files:
        args += ["-f", str(DEPLOY / f)]
    if env_file:
        args += ["--env-file", str(DEPLOY / env_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VITASCOPE_", "COMPOSE_"))}
    return subprocess.run([*args, "config"], capture_output=True, text=True, cwd=DEPLOY, env=env, timeout=60)


PROGRESS_FILE = "/tmp/startup.json"
"""Where each stage container keeps its start-up progress (`--progress-file`), read by its start-up probe."""


@pytest.mark.parametrize("env_file, profile, gpus", [(".env.usp2_fp8", "usp2_fp8", 2),
                                                      (".env.usp4_bf16", "usp4_bf16", 4)])
def test_gpu_compose_config_passes_per_profile(env_file, profile, gpus):
    result = _compose_config(["compose.yaml"], env_file)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {"pod", "encoder", "dit", "vae", "gateway"}
    for name in ("encoder", "dit", "vae", "gateway"):
        svc = services[name]
        published = ["--metrics-host", "0.0.0.0", "--progress-file", PROGRESS_FILE] if (  # the pod publishes 910x
            name != "gateway") else []  # on the host's 127.0.0.1; the health check prints the start-up progress
        assert svc["command"] == ["python", "-m", f"services.{name}", "--profile", f"configs/{profile}.yaml",
                                  *published]
        assert svc["network_mode"] == "service:pod"
        assert svc["pid"] == "service:pod"  # the encoder asks whether its callers' pids are alive
        assert svc["user"] == "10001:10001"
    for name, (health, port) in HEALTH.items():
        svc = services[name]
        assert svc["ipc"] == "service:pod" and svc["pid"] == "service:pod"
        assert svc["healthcheck"]["test"][-6:] == ["--addr", f"127.0.0.1:{port}", "--service", health,
                                                   "--progress-file", PROGRESS_FILE]
        assert {"target": "/models", "read_only": True}.items() <= svc["volumes"][0].items()
        assert {"type": "volume", "source": "compile-cache", "target": "/cache"}.items() <= svc["volumes"][1].items()
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert int(device["count"]) == gpus and device["capabilities"] == ["gpu"]
        assert services["gateway"]["depends_on"][name]["condition"] == "service_healthy"
    assert services["pod"]["ipc"] == "shareable" and services["pod"]["shm_size"]


def test_gpu_compose_refuses_to_run_without_a_profile():
    result = _compose_config(["compose.yaml"], None)
    assert result.returncode != 0
    assert "VITASCOPE_" in result.stderr


def test_tiny_cpu_compose_config_passes():
    result = _compose_config(["compose.tiny-cpu.yaml"], None)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert "deploy" not in services["dit"]  # no GPU reservation: runs anywhere
    for name in HEALTH:  # a CPU stage image, with no FlashAttention 4, from the file alone
        args = services[name]["build"]["args"]
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and args["FLASH_ATTN_4"] == "0"


def test_tiny_cpu_compose_runs_exactly_what_services_up_runs():
    up = pytest.importorskip("services.up", reason="services/up.py (bring-up command) not present yet")
    from services.common.config import load_profile

    profile_path = "configs/tiny_cpu.yaml"
    document = yaml.safe_load((DEPLOY / "compose.tiny-cpu.yaml").read_text())
    compose = document["services"]
    expected = up.service_commands(profile_path)
    assert {name: compose[name]["command"] for name in expected} == expected
    # services.up writes a checkpoint only where the profile asks (write_if_missing); tiny_cpu serves the trained
    # tree shipped in the repository, so compose has no step of its own either: exactly services.up's services.
    profile = load_profile(ROOT / profile_path)
    assert not profile.model.write_if_missing, "a profile that writes its checkpoint needs a checkpoint step here"
    assert set(compose) == set(expected)
    assert not any("services.checkpoints" in " ".join(svc.get("command", [])) for svc in compose.values())
    # The stages read the profile's model dir from the image: load_profile resolves it against the repository
    # root, which is WORKDIR /app there, and no volume may cover (and hide) it.
    model_dir = pathlib.Path(profile.model.dir).relative_to(ROOT)
    assert (ROOT / model_dir / "COMPLETE").is_file() and (ROOT / model_dir / "MANIFEST.json").is_file()
    in_image = pathlib.PurePosixPath("/app") / model_dir.as_posix()
    for name, svc in compose.items():
        for mount in svc.get("volumes", []):
            target = pathlib.PurePosixPath(mount["target"] if isinstance(mount, dict) else mount.split(":")[1])
            assert not (in_image == target or target in in_image.parents), f"{name} mounts {target} over the model"
    assert "volumes" not in document
    assert compose["encoder"]["build"]["target"] == "stage"
    _, source, _ = _stage_copy_of(model_dir)
    assert _context_excludes(source) is False
    # Same addresses: the host network and the profile's endpoints, probed with the same health names.
    for name, (health, _) in HEALTH.items():
        assert compose[name]["network_mode"] == "host"
        addr = getattr(profile.endpoints, name)
        assert compose[name]["healthcheck"]["test"][-4:] == ["--addr", addr, "--service", health]
        assert up.HEALTH_NAMES[name] == health
    assert compose["gateway"]["network_mode"] == "host"


# --- Dockerfile --------------------------------------------------------------------------------------------


def _requirement_files() -> dict[str, list[str]]:
    """deploy/requirements/*.txt: file name -> its requirement lines (comments and `-r` includes dropped)."""
    files = {}
    for path in sorted((DEPLOY / "requirements").glob("*.txt")):
        lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
        files[path.name] = [line for line in lines if line and not line.startswith("-")]
    return files


def _gencode() -> tuple[int, ...]:
    versions = [tuple(int(v) for v in m.groups()) for path in (ROOT / "vitascope").rglob("*_pb2.py")
                for m in [re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
                                    path.read_text())] if m]
    assert versions, "no generated stubs with a protobuf runtime check"
    return max(versions)


def _lower_bound(requirement: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.search(r">=([\d.]+)", requirement).group(1).split("."))


def test_dockerfile_targets_pins_and_user():
    text = (DEPLOY / "Dockerfile").read_text()
    targets = re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.M)
    assert targets == ["base", "gateway", "model-files", "stage"]
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim", text, flags=re.M)
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, flags=re.M)
    assert re.search(r'^ARG FLASH_ATTN_4_REQUIREMENT="flash-attn-4==[\w.]+"$', text, flags=re.M)
    assert re.search(r"^ARG FLASH_ATTN_4=1$", text, flags=re.M)  # on by default: the CUDA stage
    # Every install takes the requirement files (or torch / FA4 by their build args), under the constraints.
    installs = re.findall(r"pip install ((?:[^\n]|\\\n)*?)(?<!\\)\n", text)
    assert installs
    for line in installs:
        for token in line.split("&&")[0].replace("\\\n", " ").split():
            assert not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", token.strip('"')), f"unpinned requirement {token}"
    assert "PIP_CONSTRAINT=/opt/vitascope/requirements/constraints.txt" in text
    assert "pip install ." not in text and "--no-deps ." not in text  # one copy of the code, under /app
    assert "PYTHONPATH=/app" in text
    assert len(re.findall(r"(?:RUN|&&) pip check", text)) == 2  # each target ends its installs with pip check
    assert re.findall(r"python /opt/vitascope/image_check.py (\w+)", text) == ["gateway", "stage"]
    files = _requirement_files()
    assert set(files) == {"base.txt", "stage.txt", "fa4.txt", "constraints.txt"}
    requirements = [req for lines in files.values() for req in lines]
    assert len(requirements) > 15
    for req in requirements:  # every requirement pinned exactly or bounded on both sides
        assert "==" in req or (">=" in req and "<" in req.split(">=")[1]), f"unpinned: {req}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, version in re.findall(r'"([a-z][a-z0-9-]*)==([\d.]+)"', pyproject):
        for req in requirements:
            if req.startswith(f"{name}=="):
                assert req == f"{name}=={version}", f"deploy/requirements {req} vs pyproject {name}=={version}"
    assert text.count("USER vitascope") == 2  # both runnable targets drop root
    stage = text.split("AS stage", 1)[1]  # compile caches on the volume the deployments mount at /cache
    assert re.search(r"TORCHINDUCTOR_CACHE_DIR=/cache/\S+", stage) and re.search(r"TRITON_CACHE_DIR=/cache/\S+", stage)
    assert "chown -R vitascope:vitascope /app /cache" in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for source in re.findall(r"^COPY (?:--chown=\S+ )?(?!--from=)(\S+) ", text, flags=re.M):  # from the context
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
        if source.startswith("deploy/"):  # the context leaves deploy/ out, except what the build copies
            assert f"!{source.rstrip('/')}" in ignore, f"Dockerfile.dockerignore leaves out {source}"


def _targets() -> dict[str, str]:
    """deploy/Dockerfile's build targets: name -> the instructions of that target."""
    parts = re.split(r"^FROM \S+ AS (\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _copies(target: str) -> list[tuple[str, str, str]]:
    """The COPY instructions of a target, in order: (flags, source in the context, destination)."""
    return re.findall(r"^COPY((?: --\S+)*) (\S+) (\S+)$", _targets()[target], flags=re.M)


def _stage_copy_of(model_dir: pathlib.Path) -> tuple[int, str, str]:
    """The `stage` COPY that puts the repository's `model_dir` at the same path under WORKDIR /app, directly or
    through another target (`COPY --from=`): (its index among the stage's COPYs, the context source it comes from,
    the target that copied it from the context)."""
    assert re.search(r"^WORKDIR /app$", _targets()["base"], flags=re.M)
    inside = pathlib.PurePosixPath(model_dir.as_posix())
    wanted = pathlib.PurePosixPath("/app") / inside

    def place(dest: str, workdir: str) -> pathlib.PurePosixPath:
        return pathlib.PurePosixPath(workdir) / dest.rstrip("/")  # absolute destinations stay absolute

    for index, (flags, source, dest) in enumerate(_copies("stage")):
        origin = re.search(r"--from=(\S+)", flags)
        # where the source's files come from: the context, or the context via a COPY in the named target
        candidates = [(source, "stage")] if origin is None else [
            (src, origin.group(1)) for fl, src, dst in _copies(origin.group(1)) if "--from" not in fl
            if place(dst, "/") == pathlib.PurePosixPath(source.rstrip("/"))]
        for context_source, copied_in in candidates:
            source_path = pathlib.PurePosixPath(context_source.rstrip("/"))
            if (inside == source_path or source_path in inside.parents) and (
                    place(dest, "/app") / inside.relative_to(source_path) == wanted):
                return index, context_source, copied_in
    raise AssertionError(f"the stage target copies no {model_dir} to {wanted}")


def _ignore_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regular expression over context-relative paths (Go filepath.Match plus `**`)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _context_excludes(path: str) -> bool:
    """Whether deploy/Dockerfile.dockerignore leaves `path` (relative to the repository root) out of the build
    context: the last pattern matching it or a directory above it decides, a `!` pattern putting it back."""
    rel = pathlib.PurePosixPath(path.rstrip("/"))
    candidates = [rel.as_posix(), *(p.as_posix() for p in rel.parents if p.as_posix() != ".")]
    excluded = False
    for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = _ignore_pattern(line.lstrip("!").strip().strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_context_matcher_reads_the_dockerignore_as_the_build_does():
    assert _context_excludes("tests/deploy/test_deploy.py") and _context_excludes("deploy/compose.yaml")
    assert _context_excludes("services/__pycache__/up.cpython-311.pyc") and _context_excludes("checkpoints/tiny")
    assert not _context_excludes("deploy/requirements/base.txt") and not _context_excludes("deploy/image_check.py")
    assert not _context_excludes("services/up.py") and not _context_excludes("configs/tiny_cpu.yaml")


def test_stage_image_ships_the_tiny_profiles_model_before_the_code():
    from services.common.config import load_profile

    profile = load_profile(ROOT / "configs/tiny_cpu.yaml")
    assert not profile.model.write_if_missing  # nothing writes it at start-up: the image must hold it
    model_dir = pathlib.Path(profile.model.dir).relative_to(ROOT)
    index, source, copied_in = _stage_copy_of(model_dir)
    copies = _copies("stage")
    flags, from_source, _ = copies[index]
    assert "--chown" not in flags, "the model is root-owned in the image: read-only for the runtime user"
    code = min(i for i, (_, src, _) in enumerate(copies) if src.rstrip("/") in ("vitascope", "services", "configs"))
    assert index < code, "the weights' layer comes before the code's, so a code change does not rebuild it"
    stage = _targets()["stage"]
    assert stage.index(f"COPY{flags} {from_source} ") > stage.rindex("pip check")  # and after every install
    if copied_in != "stage":  # prepared in a target of its own: whatever modes the checkout has, readable by all
        prepared = _targets()[copied_in]
        assert re.search(r"^RUN chmod -R a\+rX,go-w \S+$", prepared, flags=re.M), prepared
        assert "USER" not in prepared and "--chown" not in "".join(f for f, _, _ in _copies(copied_in))
    # Every file of the shipped tree reaches the build context (the manifest lists them; COMPLETE is written last).
    manifest = json.loads((ROOT / model_dir / "MANIFEST.json").read_text())
    files = [*manifest["files"], "MANIFEST.json", "COMPLETE"]
    assert len(files) > 20 and all((ROOT / model_dir / f).is_file() for f in files)
    excluded = [f for f in files if _context_excludes((model_dir / f).as_posix())]
    assert not excluded, f"Dockerfile.dockerignore leaves out {excluded[:5]}"
    # The gateway needs no weights, and the GPU profiles keep reading theirs from the /models mount.
    assert not any(src.startswith("models") for _, src, _ in _copies("gateway"))
    for name in ("usp2_fp8", "usp4_bf16"):
        assert load_profile(ROOT / f"configs/{name}.yaml").model.dir == "/models"


def test_every_install_keeps_the_protobuf_the_stubs_were_generated_for():
    gencode = _gencode()
    constraint = next(r for r in _requirement_files()["constraints.txt"] if r.startswith("protobuf"))
    assert _lower_bound(constraint) >= gencode, f"{constraint} admits a protobuf older than the stubs' {gencode}"
    pyproject = re.search(r'"(protobuf[^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert _lower_bound(pyproject) >= gencode, f"pyproject {pyproject} vs the stubs' {gencode}"
    # FA4's CuTe DSL is pinned to a release whose libraries accept that protobuf (4.7.0's require protobuf<7).
    assert "nvidia-cutlass-dsl[cu13]==4.7.0" not in _requirement_files()["fa4.txt"]


# --- Kubernetes --------------------------------------------------------------------------------------------


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


# --- observability -----------------------------------------------------------------------------------------


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "vitascope.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_dashboard_queries_exactly_the_documented_metrics():
    used = set()
    for expr in _dashboard_exprs():
        used |= {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bvitascope_[a-z_]+", expr)}
    assert used == set(METRICS)
    documented = (ROOT / "docs" / "observability.md").read_text()
    for name, kind in METRICS.items():
        assert re.search(rf"`{name}`.*\|\s*{kind}\s*\|", documented), f"{name} ({kind}) not in docs"


def test_dashboard_histograms_use_buckets_and_counters_use_rate():
    for expr in _dashboard_exprs():
        for name in re.findall(r"\bvitascope_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if METRICS.get(base) == "histogram":
                assert name.endswith(("_bucket", "_sum", "_count")), expr
            if METRICS.get(base) == "counter":
                assert re.search(rf"(rate|increase)\({name}\[", expr), expr


def test_gateway_exports_the_dashboard_metric_names():
    from prometheus_client import CollectorRegistry

    from services.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    GatewayMetrics(registry)
    exported = {family.name for family in registry.collect()}
    gateway_side = {"vitascope_time_to_first_chunk_seconds", "vitascope_chunk_interval_seconds",
                    "vitascope_stage_latency_seconds", "vitascope_active_sessions", "vitascope_queued_sessions"}
    assert gateway_side <= exported


def _exported(registry) -> dict[str, str]:
    """Metric names a registry exposes (counters with their `_total`) and their types."""
    return {f"{f.name}_total" if f.type == "counter" else f.name: f.type for f in registry.collect()}


def test_stage_processes_export_the_dashboard_metric_names():
    import prometheus_client

    import services.common.metrics  # noqa: F401 - registers the stage metrics on the default registry

    exported = _exported(prometheus_client.REGISTRY)
    stage_side = {"vitascope_stage_latency_seconds", "vitascope_active_sessions",
                  "vitascope_transport_fallbacks_total", "vitascope_gpu_memory_bytes"}
    assert {name: exported.get(name) for name in stage_side} == {name: METRICS[name] for name in stage_side}


def test_every_exported_metric_is_documented_and_stage_buckets_agree():
    import prometheus_client
    from prometheus_client import CollectorRegistry

    from services.common.metrics import LATENCY_BUCKETS
    from services.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    gateway = GatewayMetrics(registry)
    exported = {**_exported(registry), **_exported(prometheus_client.REGISTRY)}
    documented = (ROOT / "docs" / "observability.md").read_text()
    for name, kind in exported.items():
        if name.startswith("vitascope_"):
            assert re.search(rf"`{name}`.*\|\s*{kind}\s*\|", documented), f"{name} ({kind}) not in docs"
    # The gateway's copy of the per-chunk stage seconds sums with the stages' series only with equal buckets.
    gateway.stage_latency.labels(stage="probe")
    (family,) = [f for f in registry.collect() if f.name == "vitascope_stage_latency_seconds"]
    bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
    assert bounds == [*LATENCY_BUCKETS, float("inf")]
