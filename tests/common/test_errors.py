"""One exception hierarchy and one status table: the caller's faults come back as the caller's statuses, the
server's as INTERNAL or UNAVAILABLE, and a server fault never reaches a client as its own invalid request.

The table and the hierarchy are checked directly; the stage paths run the real `DiTServicer` and `VAEServicer`
over in-process gRPC, with small fakes behind them that raise what the model code raises.
"""
import asyncio
import importlib
import inspect
import logging
import pkgutil
import types
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

import services
from services.common import errors
from services.common.errors import (ClientError, InternalError, InvalidInput, ServerError, VitascopeError,
                                    status_for)
from services.dit.api import HoldConfig
from services.dit.grpc_server import DiTServicer
from services.dit.model.adaln_cache import AdaLNCacheError
from services.dit.model.checkpoint import CheckpointConfigError
from services.dit.model.fp8 import Fp8Error
from services.gateway.pipeline import PipelineError
from services.tensors.cuda_graphs import GraphError
from services.tensors.transport import TransportError, tensor_to_parts
from services.vae.grpc_server import VAEServicer
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

pytestmark = pytest.mark.cpu

CLIENT_STATUSES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
SERVER_STATUSES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}

BASES = {VitascopeError, PipelineError}
"""Bases that sit above the two branches on purpose: never raised themselves, each kind below them picks a side."""
OUTSIDE = {"services.client"}
"""The command-line client is the caller, not a service: it imports only the wire protocol (and its error never
meets the status table)."""


# ---------------------------------------------------------------- the table


def test_the_table_maps_explicit_classes_of_one_branch_each_and_has_no_value_error_row():
    rows = dict(errors._STATUS)
    assert ValueError not in rows and RuntimeError not in rows and Exception not in rows
    for cls, code in rows.items():
        assert issubclass(cls, VitascopeError), cls
        assert issubclass(cls, ClientError) != issubclass(cls, ServerError), cls
        assert code in (CLIENT_STATUSES if issubclass(cls, ClientError) else SERVER_STATUSES), (cls, code)


def test_a_plain_value_error_is_internal_and_logged_with_its_traceback(caplog):
    try:
        raise ValueError("text_valid must be a bool tensor")
    except ValueError as exc:
        plain = exc
    with caplog.at_level(logging.ERROR, logger="services.common.errors"):
        assert status_for(plain) == grpc.StatusCode.INTERNAL
    assert len(caplog.records) == 1 and caplog.records[0].exc_info[1] is plain
    assert status_for(InvalidInput("canvas 65x64")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(TransportError("part 1 of 2 arrived after 0 parts")) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("exc", [
    AdaLNCacheError("timestep 0.3 is not cached"), GraphError("no graph for shape (7,)"),
    Fp8Error("weight is already FP8"), CheckpointConfigError("config.json hidden_size=64, the preset has 128"),
], ids=lambda e: type(e).__name__)
def test_a_server_fault_is_internal_never_invalid_argument(exc, caplog):
    with caplog.at_level(logging.ERROR, logger="services.common.errors"):
        assert status_for(exc) == grpc.StatusCode.INTERNAL
    assert isinstance(exc, InternalError) and exc.fault == "server" and caplog.records


def _exception_classes():
    for info in pkgutil.walk_packages(services.__path__, "services."):
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                yield cls


def test_every_exception_class_under_services_is_on_one_side_of_the_hierarchy():
    classes = [c for c in _exception_classes() if c.__module__ not in OUTSIDE]
    names = {c.__name__ for c in classes}
    assert {"AdaLNCacheError", "GraphError", "TransportError", "ProtocolError", "QueueFull"} <= names
    for cls in classes:
        if cls in BASES or cls in (ClientError, ServerError):
            continue
        assert issubclass(cls, VitascopeError), f"{cls.__module__}.{cls.__qualname__} is outside VitascopeError"
        assert issubclass(cls, ClientError) != issubclass(cls, ServerError), (
            f"{cls.__module__}.{cls.__qualname__} must derive from exactly one of ClientError and ServerError")


# ---------------------------------------------------------------- the stages, over gRPC


class FaultyDiT:
    """A DiT service whose sessions raise `fault` from inside `next_phase`, as the model code would."""

    def __init__(self, fault: Exception) -> None:
        self.fault = fault

    def hold_config(self, enabled: bool, max_seconds: float) -> HoldConfig:
        return HoldConfig(enabled=enabled, max_seconds=max_seconds or None)

    def open(self, config, prompt, fallback):
        session = types.SimpleNamespace(canvas=types.SimpleNamespace(width=64, height=64), kv=None,
                                        cancel_token=types.SimpleNamespace(cancelled=False))

        def next_phase():
            raise self.fault

        session.next_phase = next_phase
        session.submit_prompt = session.close_prompts = session.cancel = session.close = lambda *args: None
        return session


class FaultyVAE:
    """A VAE service whose sessions raise `fault` from inside the phase's decode."""

    def __init__(self, fault: Exception) -> None:
        self.fault = fault
        self.decode_worker = ThreadPoolExecutor(1, "vae-decode")

    def open(self, width, height, fps, sample_rate):
        def phase(video, audio):
            raise self.fault
            yield  # a generator, as DecodeSession.phase is

        return types.SimpleNamespace(phase=phase, close=lambda: None, discard=lambda: None)


async def _serve(add, servicer):
    server = grpc.aio.server()
    add(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, addr


async def _dit_status(fault: Exception, hold: dit_pb2.Hold | None = None) -> grpc.aio.AioRpcError:
    server, addr = await _serve(dit_pb2_grpc.add_DiTServicer_to_server, DiTServicer(FaultyDiT(fault), 2))
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            call = dit_pb2_grpc.DiTStub(channel).Stream()
            await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(
                session_id="s", seed=1, width=64, height=64, hold=hold)))
            for part in tensor_to_parts(torch.ones(3, 8)):
                await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="e0", embedding=part)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            return err.value
    finally:
        await server.stop(0)


@pytest.mark.parametrize("fault", [AdaLNCacheError("timestep 0.3 is not in the AdaLN cache"),
                                   GraphError("no block graph for 96 rows")], ids=lambda e: type(e).__name__)
async def test_a_server_fault_inside_a_dit_call_reaches_the_client_as_internal(fault):
    err = await _dit_status(fault)
    assert err.code() == grpc.StatusCode.INTERNAL and type(fault).__name__ in err.details()


async def test_bad_caller_input_to_the_dit_still_comes_back_as_invalid_argument():
    err = await _dit_status(AssertionError("never reached"), hold=dit_pb2.Hold(enabled=True, max_seconds=-1.0))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_seconds=-1.0" in err.details()


async def _vae_status(fault: Exception, video: torch.Tensor, truncate: bool = False) -> grpc.aio.AioRpcError:
    """The status of a Decode call of one phase; `truncate` cuts a byte off the video part (the caller's fault)."""
    server, addr = await _serve(vae_pb2_grpc.add_VAEServicer_to_server, VAEServicer(FaultyVAE(fault)))

    async def requests():
        yield vae_pb2.DecodeRequest(start=vae_pb2.DecodeStart(session_id="s", width=64, height=64))
        for part in tensor_to_parts(video):
            if truncate:
                part.host.data = part.host.data[:-1]
            yield vae_pb2.DecodeRequest(video=part)
        if truncate:  # send nothing more: a write racing the server's abort would end the call INTERNAL here
            await asyncio.Event().wait()
        for part in tensor_to_parts(torch.zeros(2, 1, 32)):
            yield vae_pb2.DecodeRequest(audio=part)
        yield vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd(request_index=0, phase_index=0))

    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in vae_pb2_grpc.VAEStub(channel).Decode(requests()):
                    pass
            return err.value
    finally:
        await server.stop(0)


async def test_a_graph_error_inside_a_vae_decode_reaches_the_client_as_internal():
    err = await _vae_status(GraphError("graph (1, 24, 2, 2) is already captured"), torch.zeros(1, 24, 2, 2))
    assert err.code() == grpc.StatusCode.INTERNAL and "GraphError" in err.details()


async def test_a_malformed_latent_part_to_the_vae_still_comes_back_as_invalid_argument():
    err = await _vae_status(AssertionError("never reached"), torch.zeros(1, 24, 2, 2), truncate=True)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "video latents" in err.details()
