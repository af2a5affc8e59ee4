"""deploy/ compose files: `docker compose config` (plugin) or `docker-compose config` (Debian package
`docker-compose`), whichever is installed, and their agreement with the profiles and `services.up`.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.dockerfile import context_excludes, stage_copy_of
from tests.deploy.shared import DEPLOY, HEALTH, PROGRESS_FILE, ROOT

pytestmark = pytest.mark.cpu


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
    _, source, _ = stage_copy_of(model_dir)
    assert context_excludes(source) is False
    # Same addresses: the host network and the profile's endpoints, probed with the same health names.
    for name, (health, _) in HEALTH.items():
        assert compose[name]["network_mode"] == "host"
        addr = getattr(profile.endpoints, name)
        assert compose[name]["healthcheck"]["test"][-4:] == ["--addr", addr, "--service", health]
        assert up.HEALTH_NAMES[name] == health
    assert compose["gateway"]["network_mode"] == "host"
