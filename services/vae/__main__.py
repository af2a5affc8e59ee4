"""`python -m services.vae --profile configs/tiny_cpu.yaml [--port N] [--device D]`"""
from services.common.grpc_server import run_stage
from services.vae.grpc_server import register
from services.vae.service import VAEService


def main() -> None:
    """Serve this stage (its options: --help)."""
    run_stage("vae", VAEService, register)


if __name__ == "__main__":
    main()
