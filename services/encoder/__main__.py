"""`python -m services.encoder --profile configs/tiny_cpu.yaml [--port N] [--device D]`"""
from services.common.grpc_server import run_stage
from services.encoder.service import EncoderStage

if __name__ == "__main__":
    run_stage("encoder", EncoderStage)
