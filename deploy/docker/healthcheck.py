"""The encoder's and the decoder's Docker HEALTHCHECK: exit 0 when every port in TANDEM_HEALTH_PORTS
answers grpc.health.v1 with SERVING, 1 otherwise.

Only grpc is imported (the check runs every 10 s beside the service). Health needs no bearer token;
with TLS, TANDEM_HEALTH_TLS_CA names the CA to trust (the certificate must name localhost), and with
mutual TLS TANDEM_HEALTH_TLS_CERT / TANDEM_HEALTH_TLS_KEY a client certificate (both, and the CA
beside them: else one line naming the variable missing, exit 1). Each is read as the
services read their PEM flags (tandem.client.flag_files, not importable here): a regular file of at
most 1 MiB, else one line naming the variable and exit 1. Read whole, /dev/zero grew the check
without bound, and a missing file was a traceback.
"""

import os
import stat
import sys

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

# The services' bound on a PEM file (flag_files.MAX_PEM_FILE_BYTES): Mozilla's whole root store is
# about 290 KB; a private CA, a chain or a key is a few KB.
MAX_PEM_FILE_BYTES = 1024 * 1024


class BadFile(Exception):
    """A TANDEM_HEALTH_TLS_* file the check cannot use; its message names the variable."""


def _pem(variable: str) -> bytes | None:
    path = os.environ.get(variable)
    if not path:
        return None
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer, and the check for its timeout.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise BadFile(f"{variable}: {path}: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory its own way
        os.close(fd)
        raise BadFile(f"{variable}: {path} is not a regular file")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(MAX_PEM_FILE_BYTES + 1)  # one byte more tells an over-long file
        except OSError as error:
            raise BadFile(f"{variable}: {path}: {error.strerror}") from None
    if len(data) > MAX_PEM_FILE_BYTES:
        bound = f"{MAX_PEM_FILE_BYTES:,} bytes, the bound of a PEM file (1 MiB)"
        raise BadFile(f"{variable}: {path} is over {bound}")
    return data


def _channel(port: str) -> grpc.Channel:
    address = f"127.0.0.1:{port}"
    ca = _pem("TANDEM_HEALTH_TLS_CA")
    if ca is None:
        for given in ("CERT", "KEY"):  # else plaintext, the client certificate silently unread
            if os.environ.get(f"TANDEM_HEALTH_TLS_{given}"):
                raise BadFile(
                    f"TANDEM_HEALTH_TLS_CA: unset, as TANDEM_HEALTH_TLS_{given} is set: mutual TLS is TLS "
                    "first, its CA the one the services' certificate is checked against"
                )
        return grpc.insecure_channel(address)
    key, cert = _pem("TANDEM_HEALTH_TLS_KEY"), _pem("TANDEM_HEALTH_TLS_CERT")
    if (key is None) != (cert is None):
        # gRPC's C++ core aborts the process on half a pair (SIGABRT: a core dump every interval).
        given, missing = ("KEY", "CERT") if cert is None else ("CERT", "KEY")
        raise BadFile(
            f"TANDEM_HEALTH_TLS_{missing}: unset, as TANDEM_HEALTH_TLS_{given} is set: a client "
            "certificate and its key go together (mutual TLS)"
        )
    tls = grpc.ssl_channel_credentials(ca, key, cert)
    return grpc.secure_channel(address, tls, options=[("grpc.ssl_target_name_override", "localhost")])


def main() -> int:
    ports = os.environ.get("TANDEM_HEALTH_PORTS", "").split()
    if not ports:  # else nothing asked and exit 0: healthy, of a service never reached
        print(
            "healthcheck: TANDEM_HEALTH_PORTS: names no port: the gRPC ports to ask, space-separated",
            file=sys.stderr,
        )
        return 1
    for port in ports:
        try:
            channel = _channel(port)
        except BadFile as error:
            print(f"healthcheck: {error}", file=sys.stderr)
            return 1  # HEALTHCHECK's unhealthy, its line kept in `docker inspect`
        with channel:
            try:
                answer = HealthStub(channel).Check(HealthCheckRequest(), timeout=3)
            except grpc.RpcError as error:  # nothing listens yet, TLS refused, ...: one line, not 18
                said = f"{error.code().name}: {error.details()}"
                print(f"healthcheck: 127.0.0.1:{port}: {said}", file=sys.stderr)
                return 1
        if answer.status != HealthCheckResponse.SERVING:  # draining, or not yet serving: say which
            status = HealthCheckResponse.ServingStatus.Name(answer.status)
            print(f"healthcheck: 127.0.0.1:{port}: {status}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
