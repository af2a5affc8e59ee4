"""The image tier: deploy/Dockerfile as shipped, built and run through deploy/compose.tiny-cpu.yaml.

- The CUDA stage's exact requirement set (torch from PyPI, deploy/requirements/stage.txt and fa4.txt, the FA4
  requirement of the Dockerfile, constraints.txt) resolves for Linux x86-64 / CPython 3.11 with no conflict and a
  protobuf no older than the gencode of vitascope/*_pb2.py (a pip dry-run; that image is too large to build here).
- The gateway and the CPU stage images build with podman, `compose.tiny-cpu.yaml` starts on them (docker-compose
  on podman's socket, inside a network namespace of its own) with no checkpoint step and no volume, every health
  check passes, each stage container holds the tiny profile's model dir as the image ships it (models/tiny under
  /app, every file as its MANIFEST.json says, nothing mounted over it, read-only for the runtime user), the
  project's client streams a session from it whose frames and audio decode, a second `up` comes up healthy again,
  and `down -v` leaves no container, volume or network behind.

Where no registry serves python:3.11-slim the base image is built from Debian's packages, and the torch wheel this
machine's pip resolves to (a CPU build) is served to the build from 127.0.0.1. The tier skips where podman cannot
be installed or run, unless VITASCOPE_IMAGES_REQUIRED=1 (.ci/run sets it). Timings and sizes are printed at the
end of the run (tests/images/conftest.py).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml

from services.common.media import VIDEO_FPS
from tests.images import harness
from tests.images.harness import REPORT

pytestmark = pytest.mark.images

REQUIREMENTS = harness.DEPLOY / "requirements"
CUDA_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
"""Every wheel tag a glibc 2.28+ x86-64 Linux accepts (pip's --platform takes only the tags it is given)."""
STAGES = ("encoder", "dit", "vae")


def _unavailable(why: str) -> None:
    if os.environ.get(harness.REQUIRED_ENV) == "1":
        pytest.fail(f"the image tier is required here ({harness.REQUIRED_ENV}=1), but {why}")
    pytest.skip(why)


def stub_gencode() -> tuple[int, int, int]:
    """The newest protobuf gencode version among the generated vitascope/*_pb2.py."""
    versions = []
    for path in (harness.ROOT / "vitascope").rglob("*_pb2.py"):
        match = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", path.read_text())
        assert match, f"{path} has no protobuf runtime version check"
        versions.append(tuple(int(g) for g in match.groups()))
    assert versions
    return max(versions)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"[\d.]+", text).group(0).rstrip(".").split("."))


def _index_reachable(index: str) -> str | None:
    context = ssl.create_default_context(cafile=str(harness.HOST_CA_BUNDLE) if harness.HOST_CA_BUNDLE.exists()
                                         else None)
    try:
        urllib.request.urlopen(f"{index.rstrip('/')}/protobuf/", timeout=20, context=context).close()
    except OSError as exc:
        return f"{index} is unreachable ({exc})"
    return None


def test_cuda_stage_requirement_set_resolves_with_the_stubs_protobuf(tmp_path):
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    if (why := _index_reachable(index)) is not None:
        _unavailable(why)
    torch = f"torch=={harness.dockerfile_arg('TORCH_VERSION')}"
    fa4 = harness.dockerfile_arg("FLASH_ATTN_4_REQUIREMENT")
    assert harness.dockerfile_arg("FLASH_ATTN_4") == "1"  # the CUDA stage's default
    report = tmp_path / "report.json"
    # --isolated: PyPI alone, not this machine's pip configuration (its CPU wheel folder and torch cap)
    args = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
            "--no-cache-dir", "--quiet", "--report", str(report), "--index-url", index,
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
            *[flag for tag in CUDA_PLATFORMS for flag in ("--platform", tag)], "--only-binary=:all:",
            "--target", str(tmp_path / "never-written"), "-c", str(REQUIREMENTS / "constraints.txt"),
            torch, "-r", str(REQUIREMENTS / "stage.txt"), "-r", str(REQUIREMENTS / "fa4.txt"), fa4]
    if harness.HOST_CA_BUNDLE.exists():
        args[4:4] = ["--cert", str(harness.HOST_CA_BUNDLE)]
    start = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    REPORT["CUDA stage requirement dry-run"] = f"{time.monotonic() - start:.0f} s"
    assert result.returncode == 0, f"the CUDA stage's requirements do not resolve:\n{result.stderr[-6000:]}"
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    REPORT["CUDA stage requirement set"] = (f"{len(resolved)} packages, torch {resolved['torch']}, protobuf "
                                            f"{resolved['protobuf']}, flash-attn-4 {resolved['flash-attn-4']}")
    assert resolved["torch"] == torch.split("==")[1]  # PyPI's build for Linux: CUDA, no local +cpu label
    assert any(name.startswith("nvidia-cudnn") for name in resolved), "not a CUDA build of torch"
    assert _version(resolved["protobuf"]) >= stub_gencode()
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "nvidia-cutlass-dsl", "quack-kernels"):
        pinned = re.search(rf"^{name}(?:\[[^\]]*\])?==(\S+)", (REQUIREMENTS / "base.txt").read_text()
                           + (REQUIREMENTS / "fa4.txt").read_text(), flags=re.M)
        assert pinned and resolved[name] == pinned.group(1), f"{name}: resolved {resolved.get(name)}"


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    try:
        return harness.Podman.prepare(tmp_path_factory.mktemp("podman"))
    except harness.Unavailable as exc:
        _unavailable(str(exc))


def _stage_build_args(wheels_url: str | None) -> tuple[str, dict[str, str]]:
    """The stage target and build args the tiny compose file gives, with torch from the loopback server."""
    stage = yaml.safe_load(harness.TINY_COMPOSE.read_text())["x-stage"]["build"]
    args = {k: os.path.expandvars(str(v)) for k, v in stage["args"].items()}
    args = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in args.items()}  # compose's defaults
    if wheels_url is not None:
        args.update(TORCH_INDEX_URL="", TORCH_FIND_LINKS=wheels_url)
    return stage["target"], args


def _local_torch_wheel(directory: pathlib.Path) -> bool:
    """Download the torch wheel this machine's pip takes for the Dockerfile's version; True if a CPU build."""
    version = harness.dockerfile_arg("TORCH_VERSION")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                             "-d", str(directory), f"torch=={version}"], capture_output=True, text=True, timeout=900)
    wheels = list(directory.glob("torch-*.whl"))
    if result.returncode != 0 or not wheels or "+cpu" not in wheels[0].name:
        for wheel in wheels:
            wheel.unlink()
        return False
    return True


def _wait_healthy(podman, compose, services, deadline_s: float) -> float:
    start = time.monotonic()
    while True:
        ids = compose.containers()
        status = {name: harness.health(podman, ids[name]) if name in ids else "absent" for name in services}
        if all(s == "healthy" for s in status.values()):
            return time.monotonic() - start
        if time.monotonic() - start > deadline_s:
            logs = {name: podman("logs", "--tail", "30", ids[name], check=False).stderr[-2000:]
                    for name in services if name in ids}
            raise AssertionError(f"not healthy after {deadline_s:.0f} s: {status}\n{logs}")
        time.sleep(2)


def _decode(path: pathlib.Path) -> dict[str, int]:
    import av

    counts = {"video": 0, "audio": 0}
    with av.open(str(path)) as container:
        size = (container.streams.video[0].width, container.streams.video[0].height)
        for frame in container.decode(*container.streams.video, *container.streams.audio):
            counts["video" if isinstance(frame, av.VideoFrame) else "audio"] += 1
    return {**counts, "width": size[0], "height": size[1]}


def test_tiny_compose_streams_a_session_through_the_built_images(podman, tmp_path):
    t0 = time.monotonic()
    base = podman.base_image()
    REPORT["base image"] = f"{base} ({podman.image_size(base) / 1e6:.0f} MB, ready after {time.monotonic() - t0:.0f} s)"
    tags = {"VITASCOPE_GATEWAY_IMAGE": "localhost/vitascope-gateway:images-test",
            "VITASCOPE_STAGE_IMAGE": "localhost/vitascope-stage-cpu:images-test"}
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    local_torch = _local_torch_wheel(wheels)
    with harness.wheel_server(wheels) as wheels_url:
        target, stage_args = _stage_build_args(wheels_url if local_torch else None)
        for name, tag, build_target, args in (("gateway", tags["VITASCOPE_GATEWAY_IMAGE"], "gateway", {}),
                                              ("CPU stage", tags["VITASCOPE_STAGE_IMAGE"], target, stage_args)):
            start = time.monotonic()
            podman.build(build_target, tag, {"PYTHON_IMAGE": base, **args})
            REPORT[f"{name} image"] = (f"{podman.image_size(tag) / 1e6:.0f} MB, built in "
                                       f"{time.monotonic() - start:.0f} s")
    assert podman.image_size(tags["VITASCOPE_GATEWAY_IMAGE"]) < 600e6  # no torch in the gateway
    assert podman.image_size(tags["VITASCOPE_STAGE_IMAGE"]) < 4e9  # a CPU build of torch, no CUDA libraries

    project = f"vitascopeimages{os.getpid()}"
    with harness.podman_service_in_namespace(podman) as namespace:
        compose = harness.Compose(podman, namespace, project, tags)
        stop = threading.Event()
        checker = threading.Thread(target=harness.drive_health_checks, args=(podman, compose, stop), daemon=True)
        checker.start()
        try:
            _first_and_second_up(podman, compose, namespace, tmp_path)
        finally:
            stop.set()
            checker.join(timeout=60)
            down = compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
            leftovers = compose.leftovers()
            for cid in leftovers["containers"]:
                podman("rm", "-f", "-v", cid, check=False)
            for volume in leftovers["volumes"]:
                podman("volume", "rm", "-f", volume, check=False)
        assert down.returncode == 0, down.stderr[-3000:]
        assert leftovers == {"containers": [], "volumes": [], "networks": []}
    REPORT["image tier, whole test"] = f"{time.monotonic() - t0:.0f} s"


def _up(podman, compose) -> None:
    """`up -d`; where compose gives up on a stage that is unhealthy for a moment (docker-compose 1.29 stops at
    the first unhealthy reading), wait for the stages' health and run `up -d` again (it starts what is left)."""
    for attempt in range(3):
        result = compose("up", "-d", "--no-build", timeout=900, check=False)
        if result.returncode == 0:
            return
        if "is unhealthy" not in result.stderr or attempt == 2:
            raise AssertionError(f"compose up exited {result.returncode}:\n{result.stderr[-4000:]}")
        _wait_healthy(podman, compose, STAGES, deadline_s=300)


MANIFEST_CHECK = """
import hashlib, json, os, pathlib, sys
root = pathlib.Path(sys.argv[1])
manifest = json.loads((root / "MANIFEST.json").read_text())
bad = [name for name, entry in manifest["files"].items()
       if hashlib.sha256((root / name).read_bytes()).hexdigest() != entry["sha256"]]
writable = [str(p) for p in (root, *root.rglob("*")) if os.access(p, os.W_OK)]
print(json.dumps({"files": len(manifest["files"]), "bytes": sum(e["bytes"] for e in manifest["files"].values()),
                  "complete": (root / "COMPLETE").is_file(), "bad": bad, "writable": writable[:5],
                  "written": os.path.exists("/app/checkpoints")}))
"""
"""Run in a stage container as its runtime user: the shipped tree against its manifest, whether any of it is
writable (the stage image copies it root-owned), and whether a checkpoint tree was written beside it."""


def _tiny_model_dir() -> tuple[pathlib.Path, str]:
    """The tiny profile's `model.dir` in the repository, and where the stages look for it: under WORKDIR /app."""
    from services.common.config import load_profile

    profile = load_profile(harness.ROOT / "configs" / "tiny_cpu.yaml")
    assert not profile.model.write_if_missing, "the tiny compose file has no checkpoint step to write a tree"
    repo = pathlib.Path(profile.model.dir)
    return repo, f"/app/{repo.relative_to(harness.ROOT).as_posix()}"


def _check_shipped_model(podman, compose, ids: dict[str, str]) -> None:
    """No checkpoint step or volume; each stage serves the model dir its image holds, intact and read-only."""
    assert set(ids) == {*STAGES, "gateway"}, f"compose ran {sorted(ids)}"
    assert compose.leftovers()["volumes"] == [], "the tiny compose file creates no volume"
    repo_dir, model_dir = _tiny_model_dir()
    shipped = json.loads((repo_dir / "MANIFEST.json").read_text())
    for name in STAGES:
        mounts = json.loads(podman("inspect", "--format", "{{json .Mounts}}", ids[name]).stdout or "[]") or []
        covering = [m["Destination"] for m in mounts
                    if model_dir == m["Destination"] or model_dir.startswith(m["Destination"].rstrip("/") + "/")]
        assert not covering, f"{name}: {covering} mounted over the shipped model"
        result = podman("exec", ids[name], "python", "-c", MANIFEST_CHECK, model_dir, timeout=120)
        found = json.loads(result.stdout.strip().splitlines()[-1])
        assert found == {"files": len(shipped["files"]), "bytes": sum(e["bytes"] for e in shipped["files"].values()),
                         "complete": True, "bad": [], "writable": [], "written": False}, f"{name}: {found}"
    REPORT["tiny model in the stage image"] = f"{model_dir}, {found['files']} files, {found['bytes'] / 1e6:.1f} MB"


def _first_and_second_up(podman, compose, namespace, tmp_path) -> None:
    start = time.monotonic()
    _up(podman, compose)
    up_s = _wait_healthy(podman, compose, (*STAGES, "gateway"), deadline_s=600) + time.monotonic() - start
    REPORT["first up until every health check passes"] = f"{up_s:.0f} s"
    first = compose.containers()
    _check_shipped_model(podman, compose, first)

    out = tmp_path / "session.mp4"
    start = time.monotonic()
    client = namespace.exec([sys.executable, "-m", "services.client", "--url",
                             "ws://127.0.0.1:8000/v1/realtime/video", "--prompt", "a lighthouse in fog",
                             "--seconds", "2", "--seed", "7", "--out", str(out)], timeout=600,
                            env={**os.environ, "PYTHONPATH": str(harness.ROOT)})
    REPORT["session through the containers"] = f"{time.monotonic() - start:.0f} s"
    assert "media chunks" in client.stdout, client.stdout[-2000:]
    decoded = _decode(out)
    assert decoded["video"] >= VIDEO_FPS and decoded["audio"] > 0, decoded  # at least a second of each
    assert (decoded["width"], decoded["height"]) == (320, 192)  # the tiny profile's default canvas

    compose("down", "--timeout", "20", timeout=300)
    assert compose.containers() == {}, "down left containers behind"
    start = time.monotonic()
    _up(podman, compose)
    again_s = _wait_healthy(podman, compose, (*STAGES, "gateway"), deadline_s=600) + time.monotonic() - start
    REPORT["second up until healthy"] = f"{again_s:.0f} s"
    second = compose.containers()
    assert set(second) == {*STAGES, "gateway"} and not set(second.values()) & set(first.values())  # new containers
    assert compose.leftovers()["volumes"] == []
