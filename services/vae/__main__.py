"""`python -m services.vae --profile configs/tiny_cpu.yaml [--port N] [--device D]`"""
from services.common.grpc_server import run_stage
from services.vae.grpc_server import register
from services.vae.service import VAEService

if __name__ == "__main__":
    run_stage("vae", VAEService, register)
