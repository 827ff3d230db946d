"""The co-location proof: a probe holds only for the same file, token and user, and no name but the one
asked for is ever opened."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tandem.common.torch_part import shared_memory as shm
from tandem.common.torch_part import shm_probe


def test_a_probe_proves_only_its_own_file_token_and_user(tmp_path: Path) -> None:
    probe = shm_probe.Probe.create(tmp_path)
    assert probe is not None
    assert shm.is_name(probe.name, shm.PROBE_PREFIX)
    assert stat.S_IMODE(os.stat(tmp_path / probe.name).st_mode) == 0o600
    assert shm_probe.probe_matches(tmp_path, probe.name, probe.token)
    assert not shm_probe.probe_matches(tmp_path, probe.name, os.urandom(shm_probe.TOKEN_BYTES))
    assert not shm_probe.probe_matches(tmp_path, shm.new_name(shm.PROBE_PREFIX), probe.token)
    elsewhere = tmp_path / "elsewhere"  # another host's /dev/shm: the file is not there
    elsewhere.mkdir()
    assert not shm_probe.probe_matches(elsewhere, probe.name, probe.token)
    probe.close()
    assert not shm_probe.probe_matches(tmp_path, probe.name, probe.token)


def test_a_probe_name_that_could_leave_the_directory_is_never_opened(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * shm_probe.TOKEN_BYTES)
    inside = tmp_path / "shm"
    inside.mkdir()
    for name in ("../secret", "secret", "tandem-probe-" + "0" * 31, "tandem-probe-" + "A" * 32):
        assert not shm_probe.probe_matches(inside, name, b"x" * shm_probe.TOKEN_BYTES)
    link = shm.new_name(shm.PROBE_PREFIX)
    (inside / link).symlink_to(secret)  # a link to a file holding the token: not followed
    assert not shm_probe.probe_matches(inside, link, b"x" * shm_probe.TOKEN_BYTES)
