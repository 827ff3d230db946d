"""TLS, mutual TLS and bearer tokens on both services, against live servers on loopback.

Certificates come from the `openssl` CLI: a throwaway CA, a server certificate for 127.0.0.1 and
localhost, a client certificate the CA signed, and a server and a client certificate signed by a
second CA that nobody trusts. Servers run in this process (`Services`), except for the test of the
flags and environment variables, which starts both services as processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.tests.ports import free_port
from tandem import cli
from tandem.client.auth import load_tokens
from tandem.client.client import ChannelSecurity, DecoderClient, EncoderClient
from tandem.client.errors import ConfigError
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.common.server import ServerOptions, TlsOptions, start_server
from tandem.decoder.api.main import config_from_args as decoder_config
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.__main__ import config_from_args as encoder_config
from tandem.up_commands import serve_command
from tandem.up_config import UpConfig
from tests.integration.reliability.harness import Services
from tests.integration.test_images import dockerfile_healthcheck_command

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="the openssl CLI makes the test certificates")

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tandem-test-token-7f3a9c0e51d2"
ROTATED_TOKEN = "tandem-test-token-older-one-b2e4"  # a second accepted token, as during a rotation
SERVING = health_pb2.HealthCheckResponse.SERVING
STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Pki:
    """PEM files of the test CA, a server and a client it signed, and a rogue CA's pair."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_server_cert: Path
    rogue_server_key: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=30)


def _make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    _openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}"),
    )
    return cert, key


def _make_leaf(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    cert, key, csr = (directory / f"{name}{suffix}" for suffix in (".pem", "-key.pem", ".csr"))
    ext = directory / f"{name}.ext"
    ext.write_text(f"basicConstraints=CA:FALSE\n{extensions}\n")
    _openssl(
        *("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}"),
    )
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-set_serial", "2"),
        *("-out", str(cert), "-days", "2", "-extfile", str(ext)),
    )
    return cert, key


def make_pki(directory: Path) -> Pki:
    server_ext = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"
    client_ext = "extendedKeyUsage=clientAuth"
    ca, rogue_ca = _make_ca(directory, "ca"), _make_ca(directory, "rogue-ca")
    server, client = (
        _make_leaf(directory, "server", ca, server_ext),
        _make_leaf(directory, "client", ca, client_ext),
    )
    rogue_server = _make_leaf(directory, "rogue-server", rogue_ca, server_ext)
    rogue_client = _make_leaf(directory, "rogue-client", rogue_ca, client_ext)
    return Pki(ca[0], *server, *client, rogue_ca[0], *rogue_server, *rogue_client)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    path.write_text(f"# accepted bearer tokens\n{TOKEN}\n\n{ROTATED_TOKEN}\n")
    return path


@pytest.fixture(scope="module")
def tls_services(tiny_model_dir: Path, tiny_fp32: LoadedModel, pki: Pki, token_file: Path):
    running = Services(
        tiny_model_dir,
        tiny_fp32,
        tls=TlsOptions(pki.server_cert, pki.server_key),
        auth_tokens=load_tokens(token_file),
    )
    yield running
    running.close()


@pytest.fixture(scope="module")
def mtls_services(tiny_model_dir: Path, tiny_fp32: LoadedModel, pki: Pki, token_file: Path):
    tls = TlsOptions(pki.server_cert, pki.server_key, client_ca_file=pki.ca)
    running = Services(tiny_model_dir, tiny_fp32, tls=tls, auth_tokens=load_tokens(token_file))
    yield running
    running.close()


def _security(pki: Pki, token: str | None = TOKEN, client: str | None = None) -> ChannelSecurity:
    """Trusting the test CA; `client` "trusted" or "rogue" adds that client certificate."""
    files = {
        "trusted": (pki.client_cert, pki.client_key),
        "rogue": (pki.rogue_client_cert, pki.rogue_client_key),
    }
    cert, key = files[client] if client is not None else (None, None)
    return ChannelSecurity(
        root_certificates=pki.ca.read_bytes(),
        certificate_chain=cert.read_bytes() if cert else None,
        private_key=key.read_bytes() if key else None,
        token=token,
    )


async def _status(call: Callable[[], Awaitable[object]]) -> grpc.StatusCode:
    try:
        await call()
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def _generate(client: DecoderClient) -> None:
    # ignore_eos: unseeded sampling on the tiny random model may draw EOS early (it did, 1 run in ~40).
    text, finished = await client.generate_text(
        ["hello there"], max_new_tokens=4, ignore_eos=True, timeout=30
    )
    assert finished.usage.output_tokens == 4


async def _statuses(services: Services, security: ChannelSecurity) -> dict[str, grpc.StatusCode]:
    """The status of one call of every kind (unary and streaming) on both services."""
    async with (
        DecoderClient(services.decoder_server.address, security=security) as decoder,
        EncoderClient(services.encoder_server.address, security=security) as encoder,
    ):
        return {
            "Decoder.Generate": await _status(lambda: _generate(decoder)),
            "Decoder.Tokenize": await _status(lambda: decoder.tokenize(["hi"])),
            "Decoder.GetModelInfo": await _status(lambda: decoder.model_info()),
            "Encoder.Embed": await _status(lambda: encoder.embed(text="hi")),
            "Encoder.GetModelInfo": await _status(
                lambda: encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), timeout=10)
            ),
        }


def _all(code: grpc.StatusCode) -> dict[str, grpc.StatusCode]:
    names = (
        "Decoder.Generate",
        "Decoder.Tokenize",
        "Decoder.GetModelInfo",
        "Encoder.Embed",
        "Encoder.GetModelInfo",
    )
    return dict.fromkeys(names, code)


def test_tls_with_an_accepted_token_serves_every_method_of_both_services(
    tls_services: Services, pki: Pki
) -> None:
    assert asyncio.run(_statuses(tls_services, _security(pki))) == _all(grpc.StatusCode.OK)
    # Every token in the file is accepted, so a token can be rotated without downtime.
    assert asyncio.run(_statuses(tls_services, _security(pki, ROTATED_TOKEN))) == _all(grpc.StatusCode.OK)


def test_no_token_is_unauthenticated_and_a_wrong_token_permission_denied(
    tls_services: Services, pki: Pki
) -> None:
    assert asyncio.run(_statuses(tls_services, _security(pki, token=None))) == _all(
        grpc.StatusCode.UNAUTHENTICATED
    )
    wrong = TOKEN[:-1] + "x"  # all but the last character right
    assert asyncio.run(_statuses(tls_services, _security(pki, token=wrong))) == _all(
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert tls_services.idle()  # denied Generate calls never reached the engine


def test_an_authorization_header_that_is_not_a_bearer_token_is_unauthenticated(
    tls_services: Services, pki: Pki
) -> None:
    async def call(value: str) -> grpc.StatusCode:
        async with DecoderClient(
            tls_services.decoder_server.address, security=_security(pki, None)
        ) as client:
            request = decoder_pb2.DecoderGetModelInfoRequest()
            metadata = (("authorization", value),)
            return await _status(lambda: client.stub.GetModelInfo(request, metadata=metadata, timeout=10))

    assert asyncio.run(call(f"Basic {TOKEN}")) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call("Bearer ")) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call(f"bearer {TOKEN}")) == grpc.StatusCode.OK  # the scheme is case-insensitive


def test_health_stays_open_without_a_token_for_probes(tls_services: Services, pki: Pki) -> None:
    async def check() -> None:
        servers = {
            "tandem.v1.Decoder": tls_services.decoder_server,
            "tandem.v1.Encoder": tls_services.encoder_server,
        }
        for service, server in servers.items():
            async with DecoderClient(server.address, security=_security(pki, token=None)) as client:
                assert await client.health() == SERVING
                assert await client.health(service) == SERVING
                await client.wait_serving(timeout=10)  # Watch, a streaming call, is open too

    asyncio.run(check())


def test_server_reflection_needs_a_token(tls_services: Services, pki: Pki) -> None:
    async def list_services(token: str | None) -> grpc.StatusCode | list[str]:
        async with DecoderClient(
            tls_services.decoder_server.address, security=_security(pki, token)
        ) as client:
            stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
            call = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            try:
                async for reply in call:
                    return [s.name for s in reply.list_services_response.service]
            except grpc.aio.AioRpcError as error:
                return error.code()
            return []

    assert asyncio.run(list_services(None)) == grpc.StatusCode.UNAUTHENTICATED
    assert "tandem.v1.Decoder" in asyncio.run(list_services(TOKEN))


async def _handshake_statuses(services: Services, security: ChannelSecurity) -> dict[str, grpc.StatusCode]:
    """Generate (never retried) and Embed (retried, so about 1.5 s when the handshake keeps failing)."""
    async with (
        DecoderClient(services.decoder_server.address, security=security) as decoder,
        EncoderClient(services.encoder_server.address, security=security) as encoder,
    ):
        return {
            "Decoder.Generate": await _status(lambda: _generate(decoder)),
            "Encoder.Embed": await _status(lambda: encoder.embed(text="hi")),
        }


def test_plaintext_and_untrusted_certificates_are_refused(tls_services: Services, pki: Pki) -> None:
    unavailable = {
        "Decoder.Generate": grpc.StatusCode.UNAVAILABLE,
        "Encoder.Embed": grpc.StatusCode.UNAVAILABLE,
    }
    plaintext = ChannelSecurity(token=TOKEN)
    assert asyncio.run(_handshake_statuses(tls_services, plaintext)) == unavailable
    distrusting = ChannelSecurity(root_certificates=pki.rogue_ca.read_bytes(), token=TOKEN)
    assert asyncio.run(_handshake_statuses(tls_services, distrusting)) == unavailable  # an unknown CA
    self_signed = ChannelSecurity(root_certificates=pki.rogue_server_cert.read_bytes(), token=TOKEN)
    assert asyncio.run(_handshake_statuses(tls_services, self_signed)) == unavailable


def test_mutual_tls_refuses_clients_without_a_certificate_the_ca_signed(
    mtls_services: Services, pki: Pki
) -> None:
    unavailable = {
        "Decoder.Generate": grpc.StatusCode.UNAVAILABLE,
        "Encoder.Embed": grpc.StatusCode.UNAVAILABLE,
    }
    no_certificate = _security(pki)
    assert asyncio.run(_handshake_statuses(mtls_services, no_certificate)) == unavailable
    untrusted_certificate = _security(pki, client="rogue")
    assert asyncio.run(_handshake_statuses(mtls_services, untrusted_certificate)) == unavailable
    assert asyncio.run(_statuses(mtls_services, _security(pki, client="trusted"))) == _all(grpc.StatusCode.OK)
    # The certificate and the token are separate checks: a trusted certificate still needs a token.
    no_token = _security(pki, token=None, client="trusted")
    assert asyncio.run(_statuses(mtls_services, no_token)) == _all(grpc.StatusCode.UNAUTHENTICATED)
    assert mtls_services.idle()


def test_cli_generate_reaches_a_tls_server_with_its_tls_and_token_flags(
    tls_services: Services, pki: Pki, token_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--address",
        tls_services.decoder_server.address,
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
    ]
    assert cli.main([*argv, "--tls-ca", str(pki.ca), "--auth-token-file", str(token_file)]) == 0
    assert "3 tokens" in capsys.readouterr().out
    assert cli.main([*argv, "--tls-ca", str(pki.ca)]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_security_settings_are_validated_and_tokens_never_printed(
    pki: Pki, token_file: Path, tmp_path: Path, environ
) -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        decoder_config(["--tls-cert", str(pki.server_cert)])
    with pytest.raises(ValueError, match="tls_client_ca needs --tls-cert and --tls-key"):
        encoder_config(["--model", "m", "--tls-client-ca", str(pki.ca)])
    with pytest.raises(ValueError, match=r"^tls_cert: .*/missing.pem: No such file or directory$"):
        decoder_config(["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(pki.server_key)])
    empty = tmp_path / "empty.txt"
    empty.write_text("# no tokens yet\n\n")
    with pytest.raises(ValueError, match="holds no token"):
        decoder_config(["--auth-token-file", str(empty)])
    options = ServerOptions(auth_tokens=load_tokens(token_file))
    assert TOKEN not in repr(options) and TOKEN not in repr(_security(pki))
    # `tandem up` hands the same files to both services.
    up = UpConfig(
        Path("m"), "127.0.0.1", 1, 2, None, None, 1.0, tls_cert=pki.server_cert, auth_token_file=token_file
    )
    for service in ("encoder", "decoder"):
        argv = serve_command(service, up)
        assert argv[argv.index("--tls-cert") + 1] == str(pki.server_cert)
        assert argv[argv.index("--auth-token-file") + 1] == str(token_file)


def test_both_services_take_tls_and_tokens_from_flags_and_environment(
    tiny_model_dir: Path, pki: Pki, token_file: Path
) -> None:
    """The encoder configured by TANDEM_ENCODER_* variables, the decoder by TANDEM_* and flags."""
    ports = {"encoder": free_port(), "decoder": free_port()}
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    encoder_env = {
        **base,
        "TANDEM_ENCODER_TLS_CERT": str(pki.server_cert),
        "TANDEM_ENCODER_TLS_KEY": str(pki.server_key),
        "TANDEM_ENCODER_AUTH_TOKEN_FILE": str(token_file),
    }
    decoder_env = {**base, "TANDEM_TLS_CERT": str(pki.server_cert), "TANDEM_TLS_KEY": str(pki.server_key)}
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--grace-s", "1"]
    processes = {
        "encoder": subprocess.Popen(
            [sys.executable, "-m", "tandem.encoder", *common, "--port", str(ports["encoder"])],
            cwd=REPO_ROOT,
            env=encoder_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        "decoder": subprocess.Popen(
            [sys.executable, "-m", "tandem.decoder", *common, "--port", str(ports["decoder"])]
            + ["--num-threads", "1", "--num-kv-blocks", "64", "--auth-token-file", str(token_file)],
            cwd=REPO_ROOT,
            env=decoder_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    }

    async def check() -> None:
        for name, port in ports.items():
            address = f"127.0.0.1:{port}"
            async with DecoderClient(address, security=_security(pki, token=None)) as open_client:
                deadline = time.monotonic() + STARTUP_TIMEOUT_S
                while await _status(lambda: open_client.health(timeout=1)) != grpc.StatusCode.OK or (
                    await open_client.health(timeout=1) != SERVING
                ):
                    assert processes[name].poll() is None, (
                        f"the {name} exited with {processes[name].returncode}"
                    )
                    assert time.monotonic() < deadline, f"the {name} never became SERVING"
                    await asyncio.sleep(0.2)
            client_type = DecoderClient if name == "decoder" else EncoderClient
            async with client_type(address, security=_security(pki, token=None)) as anonymous:
                async with client_type(address, security=_security(pki)) as authorized:
                    if isinstance(anonymous, DecoderClient):
                        assert await _status(anonymous.model_info) == grpc.StatusCode.UNAUTHENTICATED
                        assert (await authorized.model_info()).hidden_size == 64
                    else:
                        assert (
                            await _status(lambda: anonymous.embed(text="hi"))
                            == grpc.StatusCode.UNAUTHENTICATED
                        )
                        assert (await authorized.embed(text="hi")).usage.input_tokens >= 1

    try:
        asyncio.run(check())
        # The image's HEALTHCHECK speaks TLS when told which CA to trust.
        healthcheck = subprocess.run(
            ["sh", "-c", dockerfile_healthcheck_command()],
            env={
                **base,
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # `python` is this venv's
                "TANDEM_HEALTH_PORTS": " ".join(map(str, ports.values())),
                "TANDEM_HEALTH_TLS_CA": str(pki.ca),
            },
            capture_output=True,
            timeout=30,
        )
        assert healthcheck.returncode == 0, healthcheck.stderr.decode(errors="replace")
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=30) for p in processes.values()] == [0, 0]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_key_that_is_not_the_certificates_is_one_line_naming_the_flag(
    pki: Pki, tiny_model_dir: Path, environ, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.decoder.api.main import main as decoder_main

    mismatched = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.rogue_server_key)]
    assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", *mismatched]) == 2
    said = f"{pki.rogue_server_key} is not the private key of {pki.server_cert} (KEY_VALUES_MISMATCH)"
    assert capsys.readouterr().err == f"tandem serve decoder: --tls-key (TANDEM_TLS_KEY): {said}\n"
    ports = ["--encoder-port", str(free_port()), "--decoder-port", str(free_port())]
    assert cli.main(["up", "--model", str(tiny_model_dir), *ports, *mismatched]) == 2
    assert capsys.readouterr().err == f"tandem up: --tls-key (TANDEM_UP_TLS_KEY): {said}\n"


def _past_the_bound(pem: Path, path: Path) -> None:
    """`pem` at `path`, followed by zeros to one byte past 1 MiB: OpenSSL's reader passes over them."""
    path.write_bytes(pem.read_bytes())
    with path.open("r+b") as file:
        file.truncate(1024 * 1024 + 1)


@pytest.mark.parametrize(
    ("cert", "key", "client_ca", "field", "said"),
    [
        ("missing.pem", "server_key", None, "tls_cert", "/missing.pem: No such file or directory"),
        ("server_cert", "/dev/zero", None, "tls_key", "/dev/zero is not a regular file"),
        ("server_key", "server_key", None, "tls_cert", "/server-key.pem is not a PEM certificate"),
        ("server_cert", "server_cert", None, "tls_key", "/server.pem is not a PEM private key"),
        (
            "server_cert",
            "server_key",
            "server_key",
            "tls_client_ca",
            "/server-key.pem is not a PEM certificate",
        ),
        (
            "long-server.pem",
            "server_key",
            None,
            "tls_cert",
            "/long-server.pem is over 1,048,576 bytes, the bound of a certificate chain (1 MiB)",
        ),
        (
            "server_cert",
            "server_key",
            "long-ca.pem",
            "tls_client_ca",
            "/long-ca.pem is over 1,048,576 bytes, the bound of a CA bundle (1 MiB)",
        ),
    ],
)
def test_a_tls_file_a_server_cannot_use_is_refused_naming_its_field(
    pki: Pki, tmp_path: Path, cert: str, key: str, client_ca: str | None, field: str, said: str
) -> None:
    """Each is read as the clients read theirs (`tandem.client.flag_files`): a certificate file with a
    1 GiB tail of zeros passed the check, read through OpenSSL, then grew the server by 1 GiB."""
    _past_the_bound(pki.server_cert, tmp_path / "long-server.pem")
    _past_the_bound(pki.ca, tmp_path / "long-ca.pem")

    def path(name: str) -> Path:  # a Pki field, a path of the system's, or one in tmp_path
        return getattr(pki, name) if hasattr(pki, name) else tmp_path / name

    with pytest.raises(ConfigError, match=rf"^{field}: .*{re.escape(said)}$"):
        TlsOptions(path(cert), path(key), None if client_ca is None else path(client_ca))


async def test_a_server_serves_its_tls_files_as_checked_even_if_they_are_replaced_before_it_starts(
    pki: Pki, tmp_path: Path
) -> None:
    """They were read again at the start, so a file replaced in between served bytes never checked."""
    cert, key, ca = tmp_path / "server.pem", tmp_path / "server-key.pem", tmp_path / "ca.pem"
    for copy, original in ((cert, pki.server_cert), (key, pki.server_key), (ca, pki.ca)):
        copy.write_bytes(original.read_bytes())
    tls = TlsOptions(cert, key, client_ca_file=ca)
    for replaced in (cert, key, ca):
        replaced.write_text("replaced\n")
    server = await start_server(ServerOptions(port=0, tls=tls), [])
    try:
        await server.set_serving()
        security = ChannelSecurity.from_files(pki.ca, pki.client_cert, pki.client_key)
        async with DecoderClient(f"127.0.0.1:{server.port}", security=security) as client:
            assert await client.health(timeout=10) == SERVING
    finally:
        await server.stop(0)


async def test_the_security_pages_openssl_lines_make_certificates_for_mutual_tls(tmp_path: Path) -> None:
    """docs/SECURITY.md's commands, run as written: a server and a client that trust each other
    through the CA they make."""
    doc = (REPO_ROOT / "docs" / "SECURITY.md").read_text()
    block = doc.split("<!-- test-pki -->\n```sh\n", 1)[1].split("```", 1)[0]
    result = subprocess.run(
        ["sh", "-e", "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    tls = TlsOptions(tmp_path / "server.pem", tmp_path / "server-key.pem", client_ca_file=tmp_path / "ca.pem")
    server = await start_server(ServerOptions(port=0, tls=tls), [])
    try:
        await server.set_serving()
        security = ChannelSecurity.from_files(
            tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client-key.pem"
        )
        for host in ("localhost", "127.0.0.1"):  # the names the server certificate carries
            async with DecoderClient(f"{host}:{server.port}", security=security) as client:
                assert await client.health(timeout=10) == SERVING
    finally:
        await server.stop(0)
