"""What an Embed call's failure was (`encoder_faults.py`): with several encoders balanced, the operator's
WARNING line names the replica that took the call, as it said when the call began, not the whole list;
the caller's error names no encoder's address. The encoders are stand-ins of encoder_stand_in.py, each
saying its own name."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2_grpc
from tandem.common import replica_name
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.common.torch_part.prompt_parts import EncoderPrompt
from tandem.decoder.api import encoder_parts
from tandem.decoder.api.encoder_parts import EncoderParts

from .encoder_stand_in import StandIn, fetched_rows, start_fetches


async def _stand_ins(n: int) -> list[tuple[StandIn, RunningServer]]:
    """`n` stand-ins, each saying its own name as Tandem's encoder does."""
    started = []
    for _ in range(n):
        servicer = StandIn()
        server = await start_server(
            ServerOptions(host="127.0.0.1", port=0),
            [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
        )
        await server.set_serving()
        servicer.replica = replica_name.own_name("127.0.0.1", server.port)
        started.append((servicer, server))
    return started


async def test_of_encoders_balanced_a_hung_or_failing_one_is_named_alone_not_the_whole_list(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--encoder a,b`: "encoder a,b did not answer within 60 s" (or "is unavailable") left the operator
    to find which of n replicas was at fault; the one that took the call says its name as it begins.
    The callers' errors named it too, an internal address the gateway passed on to HTTP callers: now
    only the operator's WARNING lines do."""
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", 0.3)
    stand_ins = await _stand_ins(2)
    addresses = [server.address for _, server in stand_ins]
    parts = EncoderParts(",".join(addresses), torch.float32, 1 << 20, cache_bytes=0, shm_dir=tmp_path)
    caplog.set_level(logging.WARNING, logger=encoder_parts.__name__)
    try:
        # The gate shut: each Embed hangs.
        hung, _ = start_fetches(parts, [EncoderPrompt("image", f"p{i}".encode()) for i in range(4)])
        hung_errors = [await asyncio.gather(fetched_rows(part), return_exceptions=True) for part in hung]
        for servicer, _ in stand_ins:
            servicer.failure = grpc.StatusCode.INTERNAL
            servicer.gate.set()
        failing, _ = start_fetches(parts, [EncoderPrompt("image", f"q{i}".encode()) for i in range(4)])
        failing_errors = [
            await asyncio.gather(fetched_rows(part), return_exceptions=True) for part in failing
        ]
    finally:
        await parts.close()
        for _, server in stand_ins:
            await server.stop(0)
    for i, [error] in enumerate(hung_errors):
        assert isinstance(error, Unavailable)
        assert str(error) == f"prompt[{i}].encoder: the encoder did not answer within 0.3 s; retry"
    for i, [error] in enumerate(failing_errors):
        assert isinstance(error, Unavailable)
        assert str(error) == f"prompt[{i}].encoder: the encoder is unavailable (INTERNAL: out of order)"
    # Both replicas took calls, and each line named its own (once: the next in 10 s are counted): the
    # balancing is unchanged.
    assert all(servicer.num_embeds >= 1 for servicer, _ in stand_ins)
    # This module's lines alone: the stand-ins' own server logs its INTERNAL answers too, at times
    # (tandem.client.status "unhandled error in /tandem.v1.Encoder/Embed": 1 run in 10 here).
    lines = [record.getMessage() for record in caplog.records if record.name == encoder_parts.__name__]
    assert sorted(lines) == sorted(
        [
            f"encoder {address} did not answer within 0.3 s, this decoder's cap on a fetch"
            for address in addresses
        ]
        + [f"an Embed call to encoder {address} failed: INTERNAL: out of order" for address in addresses]
    )
