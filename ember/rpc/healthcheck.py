"""`python -m ember.rpc.healthcheck HOST:PORT`: exit 0 when the service answers SERVING on
grpc.health.v1 (container health checks; Kubernetes uses its native gRPC probe)."""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    address = sys.argv[1]
    try:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
