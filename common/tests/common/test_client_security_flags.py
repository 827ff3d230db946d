"""A client command's TLS and token files: each one it cannot use is refused naming its flag."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("files", "named", "said"),
    [
        (["--tls-ca", "/nonexistent"], "--tls-ca", "/nonexistent: No such file or directory"),
        (["--tls-ca", "/"], "--tls-ca", "/ is not a regular file"),
        (["--tls-ca", "/etc/hostname"], "--tls-ca", "/etc/hostname is not a PEM certificate"),
        (
            ["--tls-cert", "/dev/zero", "--tls-key", "/dev/zero"],
            "--tls-cert",
            "/dev/zero is not a regular file",
        ),
        (["--auth-token-file", "/dev/null"], "--auth-token-file", "/dev/null is not a regular file"),
        # Half a pair is refused before either file is read.
        (["--tls-key", "/etc/hostname"], "--tls-cert", "--tls-cert and --tls-key go together"),
        (["--tls-cert", "/dev/zero"], "--tls-key", "--tls-cert and --tls-key go together"),
    ],
)
def test_a_client_file_it_cannot_use_names_the_flag(
    files: list[str], named: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They said "tandem generate: [Errno 2] No such file or directory: '/nonexistent'", no flag."""
    from tandem import cli

    assert cli.main(["generate", "--address", "127.0.0.1:1", "--prompt", "hi", *files]) == 2
    variable = "TANDEM_GENERATE_" + named.removeprefix("--").replace("-", "_").upper()
    err = capsys.readouterr().err
    assert err.startswith(f"tandem generate: {named} ({variable}): ") and said in err, err
