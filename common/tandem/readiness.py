"""Whether a service serves yet: what `tandem wait` waits for and what `tandem up` announces once.

A target is a gRPC address (`host:port`: its `grpc.health.v1` status for the whole server is SERVING,
which the encoder and the decoder say once their model is loaded and warmed up) or an HTTP URL (the
OpenAI gateway's `/health`: 200 while the decoder behind it serves). Health needs no token, so only
TLS is configured. Blocking calls, for a command or a thread: nothing here needs an event loop.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.security import PLAINTEXT, ChannelSecurity

PROBE_TIMEOUT_S = 1.0  # one probe's deadline: a server that takes longer to answer is not ready
PROBE_INTERVAL_S = 0.2
# A channel that failed to connect tries again after at most this long (gRPC's default grows to 120 s).
_RECONNECT_MS = 500
# What an HTTP probe calls itself (User-Agent), as Kubernetes' kubelet sends `kube-probe/<version>`: the
# gateway writes no access line for the 503s it answers one while the decoder loads (a line every 0.2 s
# of a start), since the prober says itself what it was told (tandem.gateway.access_log).
PROBE_USER_AGENT = "tandem-readiness"


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


class Probe:
    """Asks each target whether it serves; keeps one channel per gRPC target between probes."""

    def __init__(self, targets: Sequence[str], security: ChannelSecurity = PLAINTEXT) -> None:
        self.targets = list(targets)
        self._channels = {t: _channel(t, security) for t in self.targets if not is_http(t)}

    def not_serving(self, target: str) -> str | None:
        """None when `target` serves; else why not, in a few words."""
        if is_http(target):
            try:
                request = urllib.request.Request(target, headers={"User-Agent": PROBE_USER_AGENT})
                with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
                    return None if response.status == 200 else f"HTTP {response.status}"
            except urllib.error.HTTPError as error:
                return f"HTTP {error.code}"
            except (urllib.error.URLError, OSError) as error:
                return str(getattr(error, "reason", error))
            except http.client.HTTPException as error:  # not HTTP at all: a gRPC port (BadStatusLine)
                return f"not an HTTP answer ({type(error).__name__})"
        stub = health_pb2_grpc.HealthStub(self._channels[target])
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return None if reply.status == health_pb2.HealthCheckResponse.SERVING else status

    def wait(self, timeout_s: float | None, stop: threading.Event | None = None) -> dict[str, str]:
        """Probes until every target serves (returns {}), or until `timeout_s` passes or `stop` is set
        (returns what each target that does not serve said last)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stop = stop or threading.Event()
        waiting = {target: "not asked yet" for target in self.targets}
        while True:
            for target in list(waiting):
                reason = self.not_serving(target)
                if reason is None:
                    del waiting[target]
                else:
                    waiting[target] = reason
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                return waiting
            if stop.wait(PROBE_INTERVAL_S):
                return waiting

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _channel(target: str, security: ChannelSecurity) -> grpc.Channel:
    options = [("grpc.max_reconnect_backoff_ms", _RECONNECT_MS), ("grpc.initial_reconnect_backoff_ms", 100)]
    if not security.uses_tls:
        return grpc.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        security.root_certificates, security.private_key, security.certificate_chain
    )
    return grpc.secure_channel(target, credentials, options=options)
