"""Command-line gRPC health probe (`python -m services.common.healthcheck --addr H:P --service NAME`).

Exit 0 when the named service reports SERVING, 1 otherwise, with one line on stdout saying which: docker
compose health checks and Kubernetes exec probes show that line. With `--progress-file` (the stage's own
`--progress-file`), a stage still starting says how far it got, e.g. `NOT_SERVING: DiT shards 3/8 (12.4 GiB; 41.0 s),
83.2 s after start (pid 7)`.
"""
import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.startup import read_progress


def check(addr: str, service: str, timeout: float) -> str:
    """The status name of `service` at `addr` ("SERVING", "NOT_SERVING", ...), or "UNREACHABLE"."""
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--progress-file", help="the stage's start-up progress file, printed while not serving")
    args = parser.parse_args()
    status = check(args.addr, args.service, args.timeout)
    progress = read_progress(args.progress_file) if args.progress_file and status != "SERVING" else ""
    print(f"{status}: {progress}" if progress else status, flush=True)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
