"""Fuzzing each stage's gRPC API as a direct client: the caller's faults get a named, non-INTERNAL status.

The real `EncoderServicer`, `DiTServicer` and `VAEServicer` on one in-process grpc.aio server (tests/tensors/
ipc_fakes.py's `Stages`: the compute cores behind the servicers are small fakes, the transport, ordering and slot
bookkeeping are real). Generated cases: malformed tensor parts sent to the VAE (dtype, shape, data length, part
index/count), encoder prompts (empty, huge, odd Unicode). Explicit cases: stream orderings (DiT prompt before start,
ack before any phase, two starts; VAE latents before start, phase_end without latents, two starts), oversized
messages, releases of unknown or foreign slots. After every case a real call on the same server succeeds.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from services.tensors.transport import tensor_to_parts
from tests.tensors.ipc_fakes import DIT_HELLO, VAE_HELLO, Stages, open_raw, read_phase
from vitascope.common.v1 import tensor_pb2 as pb
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

pytestmark = [pytest.mark.cpu, pytest.mark.fuzz]

CALLER_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CASES: dict[str, int] = {}
"""Cases run per test (the count the docs quote)."""
OUTCOMES: dict[str, int] = {}
"""How the generated cases ended: refused with a caller-fault status, or ended by the server before the last
write (its status then lost to the client's failed send)."""
START = vae_pb2.DecodeRequest(start=vae_pb2.DecodeStart(session_id="fuzz", width=64, height=64, consumer=VAE_HELLO))


def _count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


def assert_caller_fault(exc: grpc.aio.AioRpcError) -> None:
    assert exc.code() in CALLER_FAULTS, f"{exc.code()} for a caller's fault: {exc.details()}"
    assert exc.details(), "the status names no problem"


CLIENT_SEND_FAILED = "Internal error from Core"


async def stream_status(call, messages) -> tuple[grpc.StatusCode | None, str]:
    """Write `messages` on a streaming call (stopping once the server has ended it), read every reply, and return
    the call's status: the server's, not the client's failure to send after the server's abort."""
    for message in messages:
        try:
            await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            break
    try:
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    code, details = await call.code(), await call.details()
    if code is grpc.StatusCode.INTERNAL and details == CLIENT_SEND_FAILED:
        # the server ended the call while this client still wrote: grpc reports its own failed send, and the
        # server's status is lost (the call's replies so far were read)
        OUTCOMES["ended_before_last_write"] = OUTCOMES.get("ended_before_last_write", 0) + 1
        return None, details
    return code, details


async def expect_fault(call, messages) -> None:
    """Fail unless the streaming call ends with a caller-fault status that names its problem."""
    code, details = await stream_status(call, messages)
    assert code in CALLER_FAULTS or code is None, f"{code} for a caller's fault: {details}"
    assert details, "the status names no problem"


async def real_calls(stages: Stages, channel) -> None:
    """The stage still works: a prompt encodes, the DiT streams one phase, the VAE decodes one phase."""
    replies = [r async for r in encoder_pb2_grpc.EncoderStub(channel).Encode(
        encoder_pb2.EncodeRequest(prompt="a real prompt", session_id="after", caller=DIT_HELLO))]
    assert replies and replies[0].num_tokens == 3
    call = await open_raw(channel, VAE_HELLO)
    meta, parts = await read_phase(call)
    assert meta is not None and parts
    call.cancel()
    good = [START, *(vae_pb2.DecodeRequest(video=p) for p in tensor_to_parts(torch.full((1, 24, 4, 4), 3.0))),
            *(vae_pb2.DecodeRequest(audio=p) for p in tensor_to_parts(torch.zeros(2, 1, 32))),
            vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())]
    chunks = [r async for r in vae_pb2_grpc.VAEStub(channel).Decode(iter(good))]
    assert any(r.data == b"phase-3" for r in chunks), chunks


@pytest.fixture(scope="module")
def loop():
    runner = asyncio.Runner()
    yield runner
    runner.close()
    print(f"\nstage gRPC fuzz: {sum(CASES.values())} cases {dict(CASES)}; outcomes {dict(OUTCOMES)}")


@pytest.fixture(scope="module")
def stages(loop):
    async def up():  # the grpc.aio server and channel bind to the loop they are made in
        stages = Stages()
        await stages.__aenter__()
        return stages, grpc.aio.insecure_channel(stages.addr)

    stages, channel = loop.run(up())
    yield stages, channel
    loop.run(channel.close())
    loop.run(stages.__aexit__())


def run(loop, coro):
    return loop.run(asyncio.wait_for(coro, 30))


# ---------------------------------------------------------------- generated: tensor parts, prompts

DTYPES = st.sampled_from(list(pb.DType.values()) + [len(pb.DType.values()) + 3, 2**31 - 1])
SHAPES = st.lists(st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**40, 2**62, -(2**62)])), max_size=6)


@st.composite
def host_parts(draw) -> list[pb.TensorPart]:
    shape, dtype = draw(SHAPES), draw(DTYPES)
    count = draw(st.integers(0, 5))
    indexes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    return [pb.TensorPart(meta=pb.TensorMeta(dtype=dtype, shape=shape),
                          host=pb.HostChunk(data=draw(st.binary(max_size=256)), index=i, count=count))
            for i in indexes]


@settings(FUZZ, max_examples=80)
@given(parts=host_parts(), kind=st.sampled_from(["video", "audio"]))
def test_vae_malformed_tensor_parts(stages, loop, parts, kind):
    _count("vae_tensor_parts")
    stages_, channel = stages

    async def case():
        messages = [START, *(vae_pb2.DecodeRequest(**{kind: p}) for p in parts),
                    vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())]
        code, details = await stream_status(vae_pb2_grpc.VAEStub(channel).Decode(), messages)
        if code is not None and code is not grpc.StatusCode.OK:
            OUTCOMES["tensor_parts_refused"] = OUTCOMES.get("tensor_parts_refused", 0) + 1
        assert code in (None, grpc.StatusCode.OK) or code in CALLER_FAULTS, f"{code} for a caller's fault: {details}"

    run(loop, case())


def test_vae_still_decodes_after_malformed_parts(stages, loop):
    """Runs after the generated tensor-part cases: the VAE, the DiT and the encoder still serve real calls."""
    _count("after_tensor_parts")
    run(loop, real_calls(*stages))


PROMPTS = st.one_of(st.text(max_size=50), st.sampled_from(["", " ", "\u202e\u200f", "\x00", "x" * 200_000,
                                                           "\U0001F600" * 1000, "e\u0301" * 500]))


@settings(FUZZ, max_examples=60)
@given(prompt=PROMPTS)
def test_encoder_prompts(stages, loop, prompt):
    _count("encoder_prompts")
    _, channel = stages

    async def case():
        try:
            replies = [r async for r in encoder_pb2_grpc.EncoderStub(channel).Encode(
                encoder_pb2.EncodeRequest(prompt=prompt, session_id="fuzz", caller=DIT_HELLO))]
            assert replies
        except grpc.aio.AioRpcError as exc:
            assert_caller_fault(exc)

    run(loop, case())


# ---------------------------------------------------------------- explicit: orderings, releases, sizes

def _dit_start(session_id: str = "raw") -> dit_pb2.StreamRequest:
    return dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id=session_id, seed=1, width=64, height=64,
                                                            consumer=VAE_HELLO))


def _prompt() -> list[dit_pb2.StreamRequest]:
    return [dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(embedding=p)) for p in tensor_to_parts(torch.ones(3, 8))]


UNKNOWN_RELEASE = pb.Release(pool_id="no-such-pool", slot=9999, generation=77)
DIT_ORDERINGS = {
    "prompt_before_start": [*_prompt(), _dit_start()],
    "ack_before_start": [dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=0, phase_index=0))],
    "release_before_start": [dit_pb2.StreamRequest(release=UNKNOWN_RELEASE)],
    "two_starts": [_dit_start(), _dit_start()],
    "start_without_prompt": [_dit_start()],
    "ack_before_any_phase": [_dit_start(), *_prompt(),
                             dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=5, phase_index=3))],
    "release_unknown_slot": [_dit_start(), *_prompt(), dit_pb2.StreamRequest(release=UNKNOWN_RELEASE)],
}


@pytest.mark.parametrize("name", sorted(DIT_ORDERINGS))
def test_dit_stream_out_of_order(stages, loop, name):
    _count("dit_orderings")
    stages_, channel = stages

    async def case():
        await expect_fault(dit_pb2_grpc.DiTStub(channel).Stream(), DIT_ORDERINGS[name])
        await real_calls(stages_, channel)

    run(loop, case())


def _video(value: float = 1.0) -> list[vae_pb2.DecodeRequest]:
    return [vae_pb2.DecodeRequest(video=p) for p in tensor_to_parts(torch.full((1, 24, 4, 4), value))]


VAE_ORDERINGS = {
    "latents_before_start": _video(),
    "phase_end_before_start": [vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())],
    "two_starts": [START, START],
    "phase_end_without_latents": [START, vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())],
    "phase_end_without_audio": [START, *_video(), vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())],
    "zero_canvas": [vae_pb2.DecodeRequest(start=vae_pb2.DecodeStart(session_id="z", consumer=VAE_HELLO)),
                    *_video(), vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())],
    "foreign_cuda_ref": [START, vae_pb2.DecodeRequest(video=pb.TensorPart(
        meta=pb.TensorMeta(dtype=pb.DType.values()[1], shape=[1, 24, 4, 4]),
        cuda=pb.CudaIpcRef(pool_id="someone-elses-pool", slot=3, generation=1)))],
}


@pytest.mark.parametrize("name", sorted(VAE_ORDERINGS))
def test_vae_stream_out_of_order(stages, loop, name):
    _count("vae_orderings")
    stages_, channel = stages

    async def case():
        await expect_fault(vae_pb2_grpc.VAEStub(channel).Decode(), VAE_ORDERINGS[name])
        await real_calls(stages_, channel)

    run(loop, case())


@pytest.mark.parametrize("release", [
    UNKNOWN_RELEASE, pb.Release(), pb.Release(pool_id="", slot=2**32 - 1, generation=2**64 - 1),
], ids=["unknown_pool", "empty", "max_values"])
def test_encoder_release_of_unknown_or_foreign_slot(stages, loop, release):
    _count("encoder_releases")
    stages_, channel = stages

    async def case():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await encoder_pb2_grpc.EncoderStub(channel).Release(release)
        assert_caller_fault(info.value)
        await real_calls(stages_, channel)

    run(loop, case())


def test_oversized_messages(stages, loop):
    """A message above the server's receive limit is refused by gRPC itself (RESOURCE_EXHAUSTED)."""
    _count("oversized")
    stages_, channel = stages

    async def case():
        huge = "x" * (8 << 20)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in encoder_pb2_grpc.EncoderStub(channel).Encode(encoder_pb2.EncodeRequest(prompt=huge)):
                pass
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        await real_calls(stages_, channel)

    run(loop, case())
