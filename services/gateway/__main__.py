"""`python -m services.gateway --profile configs/tiny_cpu.yaml [--host H] [--port N]`: the websocket gateway."""
import argparse
import asyncio
import dataclasses
import logging
import os
import signal

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from services.common.config import Endpoints, GatewayConfig, load_profile
from services.common.grpc_server import started_pool
from services.common.logging_setup import configure_logging
from services.gateway.access import Access, load_tokens, load_viewer_tokens
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.ws import create_app


class AccessLog(AbstractAccessLogger):
    """One line per HTTP request: method, path without its query (a browser's `?token=` must never reach a log),
    status, bytes, seconds and peer. Successful probes of /healthz and /metrics are not logged (every few seconds)."""

    QUIET_PATHS = frozenset({"/healthz", "/metrics"})

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path in self.QUIET_PATHS and response.status < 400:
            return
        self.logger.info("%s %s %d %d B %.3f s from %s", request.method, request.path, response.status,
                         response.body_length, time, request.remote)


async def run(config: GatewayConfig, endpoints: Endpoints, access: Access) -> None:
    """Serve until SIGTERM / Ctrl-C, then close the sessions and the backend channels."""
    asyncio.get_running_loop().set_default_executor(started_pool(4, "gateway-worker"))  # a constant thread count
    pipeline = GrpcPipeline(endpoints.encoder, endpoints.dit, endpoints.vae,  # channels bind to this loop
                            drain_timeout_s=config.drain_timeout_s)
    runner = web.AppRunner(create_app(config, pipeline, access=access), access_log_class=AccessLog)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    logging.getLogger("services.gateway").info("gateway listening on http://%s:%d/", config.host, config.port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await pipeline.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="vitascope realtime gateway")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--host", help="override gateway.host")
    parser.add_argument("--port", type=int, help="override gateway.port")
    args = parser.parse_args()
    configure_logging("gateway")
    profile = load_profile(args.profile)
    config = profile.gateway
    if args.host is not None:
        config = dataclasses.replace(config, host=args.host)
    if args.port is not None:
        config = dataclasses.replace(config, port=args.port)
    access = Access(config.auth, load_tokens(config.auth, os.environ),  # tokens read here only, never logged
                    viewer_tokens=load_viewer_tokens(config.auth, os.environ))
    if config.auth.enabled:
        logging.getLogger("services.gateway").info("gateway auth on: a token is needed on the websocket%s",
                                                   " and /metrics" if config.auth.protect_metrics else "")
    asyncio.run(run(config, profile.endpoints, access))


if __name__ == "__main__":
    main()
