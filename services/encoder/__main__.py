"""`python -m services.encoder --profile configs/tiny_cpu.yaml [--port N] [--device D]`"""
from services.common.grpc_server import run_stage
from services.encoder.grpc_server import register
from services.encoder.service import EncoderService


def main() -> None:
    """Serve this stage (its options: --help)."""
    run_stage("encoder", EncoderService, register)


if __name__ == "__main__":
    main()
