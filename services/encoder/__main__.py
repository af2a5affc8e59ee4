"""`python -m services.encoder --profile configs/tiny_cpu.yaml [--port N] [--device D]`"""
import argparse
import asyncio

from services.common.config import load_profile
from services.common.grpc_server import serve
from services.common.logging_setup import configure_logging
from services.encoder.service import EncoderStage


def main() -> None:
    parser = argparse.ArgumentParser(description="vitascope text encoder stage")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--port", type=int, help="override the profile's encoder port")
    parser.add_argument("--device", help="override encoder.device")
    args = parser.parse_args()
    configure_logging("encoder")
    overrides = {"encoder": {"device": args.device}} if args.device else None
    profile = load_profile(args.profile, overrides)
    port = args.port or profile.endpoints.port_of("encoder")
    asyncio.run(serve(EncoderStage(profile), port, profile.encoder.metrics_port))


if __name__ == "__main__":
    main()
