"""`python -m services.dit --profile configs/tiny_cpu.yaml [--port N]`"""
import argparse
import asyncio

from services.common.config import load_profile
from services.common.grpc_server import serve
from services.common.logging_setup import configure_logging
from services.dit.service import DiTStage


def main() -> None:
    parser = argparse.ArgumentParser(description="vitascope DiT stage")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--port", type=int, help="override the profile's DiT port")
    args = parser.parse_args()
    configure_logging("dit")
    profile = load_profile(args.profile)
    port = args.port or profile.endpoints.port_of("dit")
    asyncio.run(serve(DiTStage(profile), port, profile.dit.metrics_port))


if __name__ == "__main__":
    main()
