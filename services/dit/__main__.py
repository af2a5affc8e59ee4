"""`python -m services.dit --profile configs/tiny_cpu.yaml [--port N]`"""
from services.common.grpc_server import run_stage
from services.dit.grpc_server import register
from services.dit.service import DiTService

if __name__ == "__main__":
    run_stage("dit", DiTService, register)
