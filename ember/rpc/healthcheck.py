"""`python -m ember.rpc.healthcheck HOST:PORT [--plaintext]`: exit 0 when the service answers SERVING on
grpc.health.v1 (container health checks). With EMBER_TLS_DIR set (the service's own certificate
folder) it dials with mTLS, as the service's peers do; `--plaintext` for the router's public port."""
from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.rpc import security


def main() -> int:
    address = sys.argv[1]
    try:
        folder = os.environ.get("EMBER_TLS_DIR")
        creds = security.Credentials.load(folder) if folder and "--plaintext" not in sys.argv else None
        with security.dial(address, creds) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
