"""`python -m services.vae --profile configs/tiny_cpu.yaml [--port N]`"""
import argparse
import asyncio

from services.common.config import load_profile
from services.common.grpc_server import serve
from services.common.logging_setup import configure_logging
from services.vae.service import VAEStage


def main() -> None:
    parser = argparse.ArgumentParser(description="vitascope VAE + mux stage")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--port", type=int, help="override the profile's VAE port")
    args = parser.parse_args()
    configure_logging("vae")
    profile = load_profile(args.profile)
    port = args.port or profile.endpoints.port_of("vae")
    asyncio.run(serve(VAEStage(profile), port, profile.vae.metrics_port))


if __name__ == "__main__":
    main()
