"""CUDA IPC between the real stage processes: the tiny preset's encoder and DiT on `cuda:0`, the VAE on `cuda:0`
or, as in the usp2 profile, on `cuda:1` (it then opens the DiT's pool on the other GPU; skipped with one GPU). The
`cuda:1` case also takes the usp2 profile's other serving options: cuDNN's attention first, the text encoder and
the audio teacher as CUDA graphs with the teacher replayed beside the students, the video decoder's ViT blocks
compiled and warmed up with its tiles shared with `cuda:0`, and the audio decoder as CUDA graphs.

One module-scoped fixture brings the services up with `services.up.bring_up` on a temporary copy of
`configs/tiny_cpu.yaml` moved to the GPU (own free ports, own checkpoint directory). The test process drives
sessions through the gateway's `GrpcPipeline` (with and without CUDA IPC) and reads the stages' Prometheus
metrics: the same session gives the same fMP4 bytes both ways, the latents (DiT → VAE) and the prompt embeddings
(encoder → DiT) really went by IPC, and over many chunks the pools are handed back slot by slot and neither the
DiT's nor the VAE's GPU memory grows.
"""
from __future__ import annotations

import asyncio
import pathlib
import re
import time
import urllib.request
from dataclasses import dataclass

import pytest
import torch
import yaml

from services.dit.group.launch import free_port
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.pipeline import MediaChunk, SessionRequest
from services.up import bring_up

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
SESSION_TIMEOUT_S = 300.0
CHUNKS = 8  # about two requests (a session's first phase goes out as two or three chunks)
LONG_CHUNKS = 48  # about twelve requests


@dataclass(frozen=True)
class Stages:
    encoder: str
    dit: str
    vae: str
    dit_metrics: str
    vae_metrics: str
    encoder_metrics: str
    vae_device: str


@pytest.fixture(scope="module", params=["cuda:0", "cuda:1"], ids=["vae_same_gpu", "vae_other_gpu"])
def stages(request, tmp_path_factory) -> Stages:
    """The real services of the tiny preset, the VAE on the parameter's GPU; stopped when the module ends."""
    vae_device = request.param
    if torch.cuda.device_count() <= int(vae_device.split(":")[1]):
        pytest.skip(f"needs {vae_device}")
    tmp = tmp_path_factory.mktemp("ipc_gpu")
    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["profile"] = "tiny_cuda_ipc"
    raw["model"]["dir"] = str(tmp / "checkpoint")
    raw["model"]["write_if_missing"] = True
    raw["endpoints"] = {name: f"127.0.0.1:{free_port('127.0.0.1')}" for name in ("encoder", "dit", "vae")}
    raw["encoder"].update(device="cuda:0", metrics_port=free_port("127.0.0.1"), cuda_ipc=True)
    raw["dit"].update(devices=["cuda:0"], metrics_port=free_port("127.0.0.1"), cuda_ipc=True)
    raw["vae"].update(device=vae_device, metrics_port=free_port("127.0.0.1"))
    if vae_device != "cuda:0":  # the rest of the usp2 profile's serving options as well
        raw["encoder"].update(cuda_graphs=True, prompt_buckets=[128, 256])
        raw["dit"].update(attention="cudnn", cuda_graphs=True, prompt_buckets=[128, 256], teacher_overlap=True)
        raw["vae"].update(compile_blocks=True, tile_devices=["cuda:0"], cuda_graphs=True)
    raw["gateway"]["port"] = free_port("127.0.0.1")
    profile = tmp / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    supervisor = bring_up(profile)
    try:
        yield Stages(raw["endpoints"]["encoder"], raw["endpoints"]["dit"], raw["endpoints"]["vae"],
                     f"http://127.0.0.1:{raw['dit']['metrics_port']}/metrics",
                     f"http://127.0.0.1:{raw['vae']['metrics_port']}/metrics",
                     f"http://127.0.0.1:{raw['encoder']['metrics_port']}/metrics", vae_device)
    finally:
        supervisor.stop_all()


def _metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a /metrics page: (name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _ipc_sent(samples, peer: str = "vae") -> float:
    return _value(samples, "vitascope_transport_tensors_total", peer=peer, mode="cuda_ipc")


def _host_sent(samples, peer: str = "vae") -> float:
    return _value(samples, "vitascope_transport_tensors_total", peer=peer, mode="host")


def _wait_dit_idle(stages: Stages, timeout_s: float = 30.0) -> dict:
    """The DiT's metrics once it reports no active session (the ended session's slots are back by then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _metrics(stages.dit_metrics)
        if _value(samples, "vitascope_active_sessions") == 0:
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"the DiT still reports a session {timeout_s:.0f} s after the last one ended")
        time.sleep(0.1)


def _session(stages: Stages, cuda_ipc: bool, chunks: int, on_chunk=None) -> list[MediaChunk]:
    """The first `chunks` media chunks of one session (seed and prompt fixed)."""
    async def run() -> list[MediaChunk]:
        pipeline = GrpcPipeline(stages.encoder, stages.dit, stages.vae, cuda_ipc=cuda_ipc)
        got: list[MediaChunk] = []
        try:
            session = await pipeline.start(SessionRequest(request_id=f"ipc-gpu-{cuda_ipc}", prompt="a lake at dawn",
                                                          seed=7, width=320, height=192, fps=24))
            stream = session.chunks()
            async for chunk in stream:
                if chunk.kind == "media":
                    got.append(chunk)
                    if on_chunk is not None:
                        on_chunk(len(got))
                if len(got) == chunks:
                    break
            await stream.aclose()
            await session.cancel()
        finally:
            await pipeline.close()
        return got

    return asyncio.run(asyncio.wait_for(run(), SESSION_TIMEOUT_S))


def _phases(chunks: list[MediaChunk]) -> int:
    """Phases the chunks belong to: each phase's video and audio latents cross DiT -> VAE once."""
    return len({(c.request_index, c.phase_index) for c in chunks})


def test_ipc_and_host_bytes_give_the_same_stream(stages):
    before, encoder_before = _wait_dit_idle(stages), _metrics(stages.encoder_metrics)
    with_ipc = _session(stages, cuda_ipc=True, chunks=CHUNKS)
    after_ipc, encoder_after_ipc = _wait_dit_idle(stages), _metrics(stages.encoder_metrics)
    with_host = _session(stages, cuda_ipc=False, chunks=CHUNKS)
    after_host, encoder_after_host = _wait_dit_idle(stages), _metrics(stages.encoder_metrics)

    assert len(with_ipc) == len(with_host) == CHUNKS
    assert [c.data for c in with_ipc] == [c.data for c in with_host]  # bit-identical latents, so bit-identical fMP4
    phases = _phases(with_ipc)
    assert _ipc_sent(after_ipc) - _ipc_sent(before) >= 2 * phases  # every phase's video and audio went by IPC
    assert _host_sent(after_ipc) == _host_sent(before)
    assert _value(after_ipc, "vitascope_transport_fallbacks_total", peer="vae") == \
        _value(before, "vitascope_transport_fallbacks_total", peer="vae")
    assert _host_sent(after_host) - _host_sent(after_ipc) >= 2 * phases
    assert _ipc_sent(after_host) == _ipc_sent(after_ipc)
    assert _value(after_host, "vitascope_transport_fallbacks_total", peer="vae") == \
        _value(after_ipc, "vitascope_transport_fallbacks_total", peer="vae") + 1  # the empty hello: counted
    assert _value(after_ipc, "vitascope_ipc_leased_slots", peer="vae") == 0
    assert _value(after_host, "vitascope_ipc_leased_slots", peer="vae") == 0
    # the prompt embedding: by IPC in the first session (its slot given back), host bytes in the second
    assert _ipc_sent(encoder_after_ipc, "dit") - _ipc_sent(encoder_before, "dit") == 1
    assert _host_sent(encoder_after_ipc, "dit") == _host_sent(encoder_before, "dit")
    assert _host_sent(encoder_after_host, "dit") - _host_sent(encoder_after_ipc, "dit") == 1
    assert _value(encoder_after_host, "vitascope_ipc_leased_slots", peer="dit") == 0


def test_many_chunks_release_every_slot_and_memory_stays_flat(stages):
    _wait_dit_idle(stages)
    dit_memory, vae_memory, leased = [], [], []

    def sample(count: int) -> None:
        dit, vae = _metrics(stages.dit_metrics), _metrics(stages.vae_metrics)
        dit_memory.append(_value(dit, "vitascope_gpu_memory_bytes", device="cuda:0"))
        vae_memory.append(_value(vae, "vitascope_gpu_memory_bytes", device=stages.vae_device))
        leased.append(_value(dit, "vitascope_ipc_leased_slots", peer="vae"))

    before = _metrics(stages.dit_metrics)
    got = _session(stages, cuda_ipc=True, chunks=LONG_CHUNKS, on_chunk=sample)
    after = _wait_dit_idle(stages)

    assert len(got) == LONG_CHUNKS
    assert _ipc_sent(after) - _ipc_sent(before) >= 2 * _phases(got)
    assert max(leased) <= 2 * 3  # the video and audio of at most max_phases_ahead + 1 phases are out
    assert _value(after, "vitascope_ipc_leased_slots", peer="vae") == 0
    # Memory is sampled at every chunk; phases differ in size, so compare the peaks of two windows of 16 chunks
    # (about four requests each): the later one must not be higher.
    early, late = slice(8, 24), slice(LONG_CHUNKS - 16, LONG_CHUNKS)
    assert max(dit_memory[late]) <= max(dit_memory[early]), dit_memory
    assert max(vae_memory[late]) <= max(vae_memory[early]), vae_memory
