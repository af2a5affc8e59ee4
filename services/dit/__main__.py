"""`python -m services.dit --profile configs/tiny_cpu.yaml [--port N]`"""
from services.common.grpc_server import run_stage
from services.dit.grpc_server import register
from services.dit.service import DiTService


def main() -> None:
    """Serve this stage (its options: --help)."""
    run_stage("dit", DiTService, register)


if __name__ == "__main__":
    main()
