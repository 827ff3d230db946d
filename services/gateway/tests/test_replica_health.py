"""One replica's health (`replica_health.py`): while its Watch is open the replica is also asked by
Check, so a process stopped with its Watch open is found by its Check running late, and found again
as it answers; a Check refused because the replica is at its bound of calls says nothing of its
health. (What a late Check counts for, given the other replicas, is `Replicas`': test_replicas.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.gateway.replicas import Replicas

from .eventually import eventually
from .fake_decoder import fake_decoder
from .stoppable_health import serve_stoppable


async def test_a_stopped_replica_whose_watch_stays_open_is_left_within_seconds_and_found_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGSTOPped decoder leaves the gateway's Watch open: it kept half of all new calls, each hung
    to its caller's timeout, until gRPC's keepalive gave up on the connection (60-80 s). A Check
    while the Watch is open, unanswered in CHECK_TIMEOUT_S, takes it out; its answer puts it back.
    (2 s and 2 s in the gateway; 0.05 s and 0.5 s here: a live replica's Check on loaded cores.)"""
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_INTERVAL_S", 0.05)
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_TIMEOUT_S", 0.5)
    async with serve_stoppable() as (health, stopped), fake_decoder() as (_, live):
        watched = Replicas(f"{stopped},{live}", grpc.aio.insecure_channel, "tandem.v1.Decoder")
        watched.start()
        try:
            await eventually(lambda: watched.serving == (stopped, live))
            health.running.clear()  # SIGSTOP
            await eventually(lambda: watched.targets == (live,))  # well within keepalive's 60-80 s
            health.running.set()  # SIGCONT
            await eventually(lambda: watched.serving == (stopped, live))
        finally:
            await watched.close()


async def test_a_replica_at_its_bound_of_calls_is_not_taken_out_by_its_refused_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica busy up to its max_concurrent_rpcs refuses a Check RESOURCE_EXHAUSTED: alive, so it
    stays a target, as its Watch says."""
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_INTERVAL_S", 0.02)
    async with serve_stoppable() as (health, busy), fake_decoder() as (_, live):
        health.is_busy = True
        watched = Replicas(f"{busy},{live}", grpc.aio.insecure_channel, "tandem.v1.Decoder")
        watched.start()
        try:
            await eventually(lambda: watched.serving == (busy, live))
            await asyncio.sleep(0.3)  # 15 Checks refused
            assert watched.serving == (busy, live)
        finally:
            await watched.close()
