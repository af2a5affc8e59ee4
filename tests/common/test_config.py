"""Profiles load into validated dataclasses, and bad values are named; no service reads another's config."""
import ast
import pathlib

import pytest

from services.common.config import DiTConfig, GatewayConfig, ModelConfig, Profile, VAEConfig, load_profile

pytestmark = pytest.mark.cpu
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny_cpu", "usp2_fp8", "usp4_bf16"])
def test_shipped_profiles_load(name):
    profile = load_profile(ROOT / "configs" / f"{name}.yaml")
    assert profile.name == name
    assert profile.dit.usp_degree == {"tiny_cpu": 1, "usp2_fp8": 2, "usp4_bf16": 4}[name]
    gpu = name != "tiny_cpu"  # the GPU profiles run FlashAttention 4; only the BF16 one merges the LoRA
    assert profile.dit.attention == ("fa4" if gpu else "default")  # (merged before FP8 it blurs the video),
    assert profile.dit.merge_lora == (name == "usp4_bf16")
    assert profile.vae.compile_blocks == gpu  # and the video decoder's ViT blocks compiled
    # the real model keeps the official anchor until it is checked on the real weights; the tiny one needs "prompt"
    assert profile.dit.renormalise_anchor == ("session" if gpu else "prompt")
    assert isinstance(profile.gateway, GatewayConfig)  # the canvases typed, YAML lists read as tuples
    assert all(type(c) is tuple and len(c) == 2 for c in profile.gateway.allowed_canvases)
    assert profile.gateway.default_canvas == {"tiny_cpu": (320, 192)}.get(name, (864, 480))


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("model: {preset: tiny, dir: x}\ndit: {devcies: [cpu]}\n")
    with pytest.raises(ValueError, match="unknown keys \\['devcies'\\]"):
        load_profile(p)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="model.preset='huge'"):
        ModelConfig(preset="huge", dir="x")
    with pytest.raises(ValueError, match="USP degree must be 1, 2 or 4"):
        DiTConfig(devices=("cuda:0", "cuda:1", "cuda:2"))
    with pytest.raises(ValueError, match="entry 200"):
        DiTConfig(canvas_short_edges=(200,))
    with pytest.raises(ValueError, match="dit.attention='flash3': use one of \\('default', 'cudnn', 'fa4'\\)"):
        DiTConfig(attention="flash3")
    with pytest.raises(ValueError, match="dit.renormalise_anchor='request': use one of \\('session', 'prompt'\\)"):
        DiTConfig(renormalise_anchor="request")
    with pytest.raises(ValueError, match="dit.merge_lora='yes': must be true or false"):
        DiTConfig(merge_lora="yes")
    with pytest.raises(ValueError, match="dit.reuse_text_kv=1: must be true or false"):
        DiTConfig(reuse_text_kv=1)


def test_vae_tile_overlap_is_validated():
    assert VAEConfig(tile_overlap_px=32).tile_overlap_px == 32
    for bad in (0, 24, 256, "32"):
        with pytest.raises(ValueError, match="vae.tile_overlap_px"):
            VAEConfig(tile_overlap_px=bad)


def test_gateway_section_is_typed_and_checked_on_load(tmp_path):
    p = tmp_path / "p.yaml"
    model = "model: {preset: tiny, dir: x}\n"
    p.write_text(model + "gateway: {allowed_canvases: [[320, 192]], default_canvas: [320, 192]}\n")
    assert load_profile(p).gateway.allowed_canvases == ((320, 192),)
    p.write_text(model + "gateway: {alowed_canvases: [[320, 192]]}\n")
    with pytest.raises(ValueError, match="profile section 'gateway': unknown keys \\['alowed_canvases'\\]"):
        load_profile(p)
    p.write_text(model + "gateway: {allowed_canvases: [[320, 191]], default_canvas: [320, 191]}\n")
    with pytest.raises(ValueError, match="entry \\[320, 191\\]: must be a \\[width, height\\] pair"):
        load_profile(p)
    assert Profile(name="p", model=ModelConfig(preset="tiny", dir="x")).gateway == GatewayConfig()


def test_gateway_broadcast_section_is_typed_and_checked_on_load(tmp_path):
    p = tmp_path / "p.yaml"
    model = "model: {preset: tiny, dir: x}\n"
    p.write_text(model + "gateway: {broadcast: {viewer_queue_chunks: 2, max_viewers: 10}}\n")
    broadcast = load_profile(p).gateway.broadcast
    assert (broadcast.viewer_queue_chunks, broadcast.max_viewers, broadcast.viewer_max_skips) == (2, 10, 3)
    p.write_text(model + "gateway: {broadcast: {max_viewer: 10}}\n")
    with pytest.raises(ValueError, match="'gateway.broadcast': unknown keys \\['max_viewer'\\]"):
        load_profile(p)
    for bad, match in (("viewer_queue_chunks: 0", "viewer_queue_chunks=0: must be >= 1"),
                       ("viewer_max_skips: -1", "viewer_max_skips=-1: must be >= 0"),
                       ("retain_s: 0", "retain_s=0: must be > 0 seconds")):
        p.write_text(model + f"gateway: {{broadcast: {{{bad}}}}}\n")
        with pytest.raises(ValueError, match=match):
            load_profile(p)


@pytest.mark.parametrize("canvases, default, match", [
    ((), (480, 864), "gateway.allowed_canvases is empty"),
    ([[480, 864], [864]], (480, 864), "entry \\[864\\]: must be a \\[width, height\\] pair"),
    (((480, 865),), (480, 865), "entry \\(480, 865\\): must be .* positive even ints"),
    (((0, 864),), (0, 864), "entry \\(0, 864\\)"),
    ((("480", 864),), (480, 864), "entry \\('480', 864\\)"),
    ((480, 864), (480, 864), "entry 480: must be a \\[width, height\\] pair"),
    ("480x864", (480, 864), "gateway.allowed_canvases='480x864': must be a list"),
    (((480, 864),), (864, 480), "gateway.default_canvas=\\[864, 480\\] is not in gateway.allowed_canvases "
                                "\\[\\[480, 864\\]\\]: pick one of them or add it"),
    (((480, 864),), (480,), "gateway.default_canvas \\(480,\\): must be a \\[width, height\\] pair"),
])
def test_bad_canvas_is_named(canvases, default, match):
    with pytest.raises(ValueError, match=match):
        GatewayConfig(allowed_canvases=canvases, default_canvas=default)


def test_canvases_become_tuples():
    config = GatewayConfig(allowed_canvases=[[320, 192], [192, 320]], default_canvas=[192, 320])
    assert config.allowed_canvases == ((320, 192), (192, 320)) and config.default_canvas == (192, 320)
    hash(config)  # frozen and hashable: no list left inside


@pytest.mark.parametrize("field, value", [("num_slots", 0), ("max_prompt_chars", 0), ("fps", 0),
                                          ("queue_limit", -1), ("heartbeat_s", 0), ("port", 70000)])
def test_bad_gateway_value_is_named(field, value):
    with pytest.raises(ValueError, match=f"gateway.{field}={value}: must be"):
        GatewayConfig(**{field: value})


SERVICES = ("gateway", "encoder", "dit", "vae")


def imported_modules(path: pathlib.Path, package: str) -> set[str]:
    """Every module `path` imports, relative imports resolved against `package` (the file's own package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def foreign_service_imports(service: str) -> list[str]:
    """The imports of another service's package made anywhere in `services/<service>/`."""
    others = [f"services.{name}" for name in SERVICES if name != service]
    bad = []
    for path in sorted((ROOT / "services" / service).rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).parent.parts)
        for module in imported_modules(path, package):
            if any(module == other or module.startswith(other + ".") for other in others):
                bad.append(f"{path.relative_to(ROOT)}: {module}")
    return bad


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_imports_another_services_package(service):
    assert (ROOT / "services" / service / "__init__.py").is_file()
    assert foreign_service_imports(service) == []


def test_the_import_rule_sees_absolute_and_relative_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("import services.gateway.config\nfrom ...vae import mux\nfrom ... import encoder\n"
                    "from ..model import lora\ndef f():\n    from services.encoder.model import TextEncoder\n")
    found = imported_modules(path, "services.dit.stream")
    assert {"services.gateway.config", "services.vae.mux", "services.encoder",
            "services.encoder.model.TextEncoder", "services.dit.model.lora"} <= found
