"""deploy/Dockerfile and deploy/requirements/: targets, pins, the runtime user, what the images ship and the
protobuf every install keeps.
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from tests.deploy.dockerfile import context_excludes, copies_of, dockerfile_targets, stage_copy_of
from tests.deploy.shared import DEPLOY, ROOT

pytestmark = pytest.mark.cpu


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


def test_context_matcher_reads_the_dockerignore_as_the_build_does():
    assert context_excludes("tests/deploy/test_compose.py") and context_excludes("deploy/compose.yaml")
    assert context_excludes("services/__pycache__/up.cpython-311.pyc") and context_excludes("checkpoints/tiny")
    assert not context_excludes("deploy/requirements/base.txt") and not context_excludes("deploy/image_check.py")
    assert not context_excludes("services/up.py") and not context_excludes("configs/tiny_cpu.yaml")


def test_stage_image_ships_the_tiny_profiles_model_before_the_code():
    from services.common.config import load_profile

    profile = load_profile(ROOT / "configs/tiny_cpu.yaml")
    assert not profile.model.write_if_missing  # nothing writes it at start-up: the image must hold it
    model_dir = pathlib.Path(profile.model.dir).relative_to(ROOT)
    index, source, copied_in = stage_copy_of(model_dir)
    copies = copies_of("stage")
    flags, from_source, _ = copies[index]
    assert "--chown" not in flags, "the model is root-owned in the image: read-only for the runtime user"
    code = min(i for i, (_, src, _) in enumerate(copies) if src.rstrip("/") in ("vitascope", "services", "configs"))
    assert index < code, "the weights' layer comes before the code's, so a code change does not rebuild it"
    stage = dockerfile_targets()["stage"]
    assert stage.index(f"COPY{flags} {from_source} ") > stage.rindex("pip check")  # and after every install
    if copied_in != "stage":  # prepared in a target of its own: whatever modes the checkout has, readable by all
        prepared = dockerfile_targets()[copied_in]
        assert re.search(r"^RUN chmod -R a\+rX,go-w \S+$", prepared, flags=re.M), prepared
        assert "USER" not in prepared and "--chown" not in "".join(f for f, _, _ in copies_of(copied_in))
    # Every file of the shipped tree reaches the build context (the manifest lists them; COMPLETE is written last).
    manifest = json.loads((ROOT / model_dir / "MANIFEST.json").read_text())
    files = [*manifest["files"], "MANIFEST.json", "COMPLETE"]
    assert len(files) > 20 and all((ROOT / model_dir / f).is_file() for f in files)
    excluded = [f for f in files if context_excludes((model_dir / f).as_posix())]
    assert not excluded, f"Dockerfile.dockerignore leaves out {excluded[:5]}"
    # The gateway needs no weights, and the GPU profiles keep reading theirs from the /models mount.
    assert not any(src.startswith("models") for _, src, _ in copies_of("gateway"))
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
