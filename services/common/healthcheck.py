"""Command-line gRPC health probe (`python -m services.common.healthcheck --addr H:P --service NAME`).

Exit 0 when the named service reports SERVING, 1 otherwise; used by docker compose health checks.
"""
import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str, timeout: float) -> bool:
    """True when `service` at `addr` answers SERVING within `timeout` seconds."""
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    return 0 if check(args.addr, args.service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
