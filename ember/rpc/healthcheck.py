"""`python -m ember.rpc.healthcheck [--tls-dir DIR | --plaintext] HOST:PORT`: exit 0 when the service
answers SERVING on grpc.health.v1 (container health checks and Kubernetes exec probes).

It dials with mTLS, as the service's peers do, when it is given a certificate folder: `--tls-dir`
(the service's own folder, e.g. /etc/ember/tls/kvstore-central in the shipped Compose file and
Kubernetes manifests), else EMBER_TLS_DIR. `--plaintext` (the router's public port) ignores both."""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.rpc import security


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ember.rpc.healthcheck",
                                description="exit 0 when HOST:PORT answers SERVING on grpc.health.v1")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--tls-dir", help="a certificate folder (ca.crt, tls.crt, tls.key) to dial with mTLS "
                                     "(default: $EMBER_TLS_DIR; neither: plaintext)")
    p.add_argument("--plaintext", action="store_true", help="dial without TLS (the router's public port)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = None if args.plaintext else (args.tls_dir or os.environ.get("EMBER_TLS_DIR"))
    try:
        creds = security.Credentials.load(folder) if folder else None
    except (OSError, ValueError) as e:
        print(f"{args.address}: {e}", file=sys.stderr)
        return 1
    try:
        with security.dial(args.address, creds) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}", file=sys.stderr)
        return 1
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
