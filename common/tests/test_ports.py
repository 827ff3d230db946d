"""The test servers' ports (ports.py): under the kernel's ephemeral range, one slice per xdist worker."""

from __future__ import annotations

import socket

import pytest

from common.tests import ports


def test_each_worker_has_a_slice_of_its_own_under_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(ports._slice()))
    assert all(len(s) == (ports.HIGH - ports.LOW) // 3 for s in slices)
    assert not (slices[0] & slices[1] or slices[1] & slices[2] or slices[0] & slices[2])
    assert max(max(s) for s in slices) < 32_768  # Linux's default ephemeral range starts there


def test_a_port_bound_on_127_0_0_1_is_never_picked_while_held() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        port = held.getsockname()[1]
        picks = [ports.free_port() for _ in range(len(ports._PORTS))]  # the whole slice, in turn
    assert port not in picks
    assert set(picks) <= set(ports._PORTS)
