"""The encoder's and the decoder's Docker HEALTHCHECK: exit 0 when every port in TANDEM_HEALTH_PORTS
answers grpc.health.v1 with SERVING, 1 otherwise.

Only grpc is imported (the check runs every 10 s beside the service). Health needs no bearer token;
with TLS, TANDEM_HEALTH_TLS_CA names the CA to trust (the certificate must name localhost), and with
mutual TLS TANDEM_HEALTH_TLS_CERT / TANDEM_HEALTH_TLS_KEY a client certificate.
"""

import os
import sys

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub


def _pem(variable: str) -> bytes | None:
    path = os.environ.get(variable)
    return open(path, "rb").read() if path else None


def _channel(port: str) -> grpc.Channel:
    address = f"127.0.0.1:{port}"
    ca = _pem("TANDEM_HEALTH_TLS_CA")
    if ca is None:
        return grpc.insecure_channel(address)
    tls = grpc.ssl_channel_credentials(ca, _pem("TANDEM_HEALTH_TLS_KEY"), _pem("TANDEM_HEALTH_TLS_CERT"))
    return grpc.secure_channel(address, tls, options=[("grpc.ssl_target_name_override", "localhost")])


def main() -> int:
    for port in os.environ["TANDEM_HEALTH_PORTS"].split():
        with _channel(port) as channel:
            answer = HealthStub(channel).Check(HealthCheckRequest(), timeout=3)
        if answer.status != HealthCheckResponse.SERVING:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
