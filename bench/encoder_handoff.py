"""Encoder to decoder: the rows carried by the client, fetched by the decoder as gRPC bytes, or fetched
over shared memory (issue 52).

Both services run in this process on loopback gRPC (the real servicers and the decoder's own fetch,
`tandem.decoder.api.encoder_parts`), so the three paths differ only in how the rows travel:
- carried: the client calls Embed (token IDs in, rows back), then sends the rows in its Generate;
- bytes: the client sends an `encoder` part, the decoder calls Embed and gets the rows in the reply
  (the encoder's /dev/shm is another directory here: what two hosts see);
- shm: the same, the encoder on this host: the rows come through a segment of the encoder's pool in
  /dev/shm (created by the warm-up round, reused after).

Two measures:
1. Handoff, per span: the time from the caller's start until the decoder holds the rows as a tensor,
   and the bytes that cross gRPC. The spans: LLaVA-1.5's 576 x 4,096 bf16 image span (a random
   4,096-wide table stands in for its tower: the tower's time is the same on every path) and
   SmolLM2's [n, 576] bf16 rows, n = 128 ... 8,190. For carried, the second leg goes to a sink
   server that parses the Generate request and decodes its rows as the decoder does. Beside it, the
   move alone, tensor to tensor, on one intra-op thread: into a pooled segment and out of it checked
   through the reader's mapping, alternating in one loop with the move of rows a lookup's gather
   wrote straight into the segment (text and token-ID calls; the gather left out, as the copied-in
   move's rows are made before its clock starts), back to back (the caches warm, as for rows just
   made by the encoder's model) and each move after a 64 MiB pass that leaves none of its bytes
   cached (cold); the first move, which creates the segment and the mapping; through a reply's
   bytes; one keyed digest of the span (each side of a shared-memory move computes one); the
   shared-memory move without its digests, warm and cold. The decoder reads with its fused copy and
   digest (`tandem.decoder.backends.cpu.copy_digest`) where the CPU has it; the gathered-in move is
   also timed with the reader's two passes (numpy's copy, then the GMAC), alternating with it in the
   same loop, and so is the read alone, memory to memory. Against the machine's copy bandwidth:
   numpy `copyto` of a buffer of the same size (in cache) and of 256 MiB (memory), the latter again
   beside each span's moves, since the load moves by the minute.
2. TTFT on SmolLM2 (bf16, prefix caching off, the embedding cache off, fresh token IDs each run):
   `Finished.time_to_first_token_s` is the decoder's; the client's wall time to the first token
   includes the carried path's Embed call. Prefill dominates as n grows: the paths part by the
   handoff's milliseconds.
Paths are interleaved, the order rotating per repeat, the median kept; the load average is printed
at the start and the end with the CPU's model and flags.

  .venv/bin/python bench/encoder_handoff.py [--repeats 5] [--ttft-rows 128,1024,4096,8190]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.client.client import DecoderClient, EncoderClient, EncoderPart  # noqa: E402
from tandem.client.pb.tandem.v1 import (  # noqa: E402
    decoder_pb2,
    decoder_pb2_grpc,
    encoder_pb2,
    tensor_pb2,
)
from tandem.common.server import ServerOptions, Service, start_server  # noqa: E402
from tandem.common.torch_part import (  # noqa: E402
    shared_memory,
    shm_digest,
    shm_pool,
    shm_probe,
    shm_segment_maps,
    tensors,
)
from tandem.common.torch_part.model_cache import resolve_model  # noqa: E402
from tandem.common.torch_part.prompt_parts import EncoderPrompt  # noqa: E402
from tandem.decoder.api.encoder_parts import EncoderParts  # noqa: E402
from tandem.decoder.api.servicer import DecoderServicer  # noqa: E402
from tandem.decoder.backends.cpu import copy_digest  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.encoder.config import EncoderConfig  # noqa: E402
from tandem.encoder.lookup import LookupEmbedder  # noqa: E402
from tandem.encoder.servicer import EncoderServicer  # noqa: E402
from tandem.encoder.shared_segments import SharedSegments, SharedTarget  # noqa: E402

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SPANS = [("llava-1.5 image span", 576, 4096), *((f"smollm2 n={n}", n, 576) for n in (128, 1024, 4096, 8190))]
PATHS = ("carried", "bytes", "shm")


def machine() -> dict[str, object]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line), "?")
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )
    wanted = (
        *("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16"),
        *("aes", "vaes", "pclmulqdq", "vpclmulqdq"),  # the digest's AES-GMAC runs on these
    )
    return {"cpu": model, "flags": [f for f in wanted if f in flags], "cores": os.cpu_count()}


DRAM_COPY_BYTES = 256 << 20  # a copy this large runs at the memory's speed, not the caches'
EVICT_BYTES = 64 << 20  # twice the measured machine's 32 MiB L3: a pass over it leaves none of a move's bytes


class Evictor:
    """Leaves the caches holding none of a move's bytes: a write pass over EVICT_BYTES of its own."""

    def __init__(self) -> None:
        self.buffer = np.zeros(EVICT_BYTES, dtype=np.uint8)  # [EVICT_BYTES]

    def __call__(self) -> None:
        np.add(self.buffer, 1, out=self.buffer)


def transfer_ms(rows: torch.Tensor, repeats: int, evict: Evictor) -> dict[str, float]:
    """The rows' move alone, tensor to tensor, median ms:
    - "shm": copied into a segment of the encoder's pool and out of it checked (what the encoder's
      batch and the decoder's fetch do for rows made elsewhere: a vision tower's), and "shm_written":
      the same with the rows written straight into the segment by a lookup's gather (what a text or
      token-ID call's rows take), the gather's own time left out, as it is of "shm" (its rows are
      made before the clock starts). The two alternate in one loop, moves back to back (the caches
      warm, as for rows just made by the encoder's model), and again each after `evict`, nothing
      cached ("shm_cold", "shm_written_cold"); "shm_first": the first move, which creates the segment
      and the reader's mapping of it, both reused by the others; "gather": the gather into the
      segment, "gather_fresh": the same into memory of its own (the copy's source in "shm");
    - "digest": one keyed digest of the rows, back to back (each side of a move computes one);
    - "bytes": through a reply's bytes (encode, serialize, parse, decode)."""
    probe = shm_probe.Probe.create()
    assert probe is not None
    segments = SharedSegments(shared_memory.SHM_DIR, 1 << 30, 16, 10.0)
    # The decoder's, kept as it keeps them: reading with two passes (numpy's copy, then OpenSSL's
    # GMAC: the reader before the fused kernel) and with the fused copy and digest where this CPU has it.
    two_pass = shm_segment_maps.SegmentMaps(shared_memory.SHM_DIR)
    fused = shm_segment_maps.SegmentMaps(shared_memory.SHM_DIR, copy_digest=copy_digest.for_cpu())
    raw = rows.view(torch.int16).numpy() if rows.dtype.itemsize == 2 else rows.numpy()
    ids = torch.arange(rows.shape[0])  # the gather of every row of `rows`: the same bytes
    moves = 2 * repeats + 1
    gathers: dict[str, list[float]] = {"gather": [], "gather_fresh": []}

    def move(
        write: Callable[[SharedTarget], tensor_pb2.SharedTensor | None],
        check: bool = False,
        maps: shm_segment_maps.SegmentMaps = fused,
    ) -> float:
        offer = encoder_pb2.SharedMemoryOffer(
            probe_name=probe.name,
            probe_token=probe.token,
            segment_name=shared_memory.new_name(shared_memory.SEGMENT_PREFIX),
            digest_key=os.urandom(shm_digest.KEY_BYTES),
        )
        gathered = len(gathers["gather"])
        start = time.perf_counter()
        target = segments.target(offer)
        assert target is not None
        handle = write(target)
        assert handle is not None
        segment = maps.open(handle.name)
        with segment:
            read = tensors.decode_shared(handle, segment, offer.digest_key, rank=2)
        shared_memory.remove(shared_memory.SHM_DIR, handle.name)  # released: the next move reuses it
        elapsed = time.perf_counter() - start - sum(gathers["gather"][gathered:])
        # Only in the warm-up: reading both again would leave the next move's caches colder.
        assert read.shape == rows.shape and (not check or torch.equal(read, rows))
        return elapsed

    def gather_into(out: torch.Tensor) -> None:
        start = time.perf_counter()
        torch.index_select(rows, 0, ids, out=out)
        gathers["gather"].append(time.perf_counter() - start)

    def shm(check: bool = False, maps: shm_segment_maps.SegmentMaps = fused) -> float:
        start = time.perf_counter()
        made = torch.index_select(rows, 0, ids)  # before the clock, as a tower's rows would be
        gathers["gather_fresh"].append(time.perf_counter() - start)
        return move(lambda target: target.write(made, None), check, maps)

    def written(check: bool = False, maps: shm_segment_maps.SegmentMaps = fused) -> float:
        return move(lambda target: target.write_with(list(rows.shape), rows.dtype, gather_into), check, maps)

    def written_two_pass() -> float:
        return written(maps=two_pass)

    def digest() -> float:
        start = time.perf_counter()
        shm_digest.keyed_digest(raw, os.urandom(shm_digest.KEY_BYTES))
        return time.perf_counter() - start

    source = raw.reshape(-1).view(np.uint8)  # [num_bytes]
    read_out = np.empty_like(source)

    def read(copy_and_digest: shm_digest.CopyDigest) -> Callable[[], float]:
        def timed() -> float:
            start = time.perf_counter()
            copy_and_digest(source, read_out, os.urandom(shm_digest.KEY_BYTES))
            return time.perf_counter() - start

        return timed

    def carried() -> float:
        start = time.perf_counter()
        data = encoder_pb2.EmbedResponse(embeddings=tensors.encode(rows)).SerializeToString()
        tensors.decode(encoder_pb2.EmbedResponse.FromString(data).embeddings, rank=2)
        return time.perf_counter() - start

    def cold(measure: Callable[[], float]) -> float:
        evict()
        return measure()

    first = shm(check=True)
    shm(check=True), written(check=True), written(check=True, maps=two_pass)
    times: dict[str, list[float]] = {
        name: []
        for name in (
            *("shm", "shm_written", "shm_written_two_pass"),
            *("shm_cold", "shm_written_cold", "shm_written_two_pass_cold"),
        )
    }
    for _ in range(moves):
        times["shm"].append(shm())
        times["shm_written"].append(written())
        times["shm_written_two_pass"].append(written_two_pass())
    for _ in range(moves):
        times["shm_cold"].append(cold(shm))
        times["shm_written_cold"].append(cold(written))
        times["shm_written_two_pass_cold"].append(cold(written_two_pass))
    times["digest"] = [digest() for _ in range(moves)]
    # The decoder's read alone, memory to memory, back to back: the two passes and the fused one.
    reads = {"read_two_pass": read(shm_digest.copy_then_digest), "read_fused": read(fused.copy_digest)}
    for name in reads:
        times[name] = []
    for _ in range(moves):
        for name, timed in reads.items():
            times[name].append(timed())
    times["bytes"] = [carried() for _ in range(repeats)]
    assert segments.num_created == fused.num_mapped == two_pass.num_mapped == 1, (
        "every move reused its segment"
    )
    segments.close()
    fused.close()
    two_pass.close()
    probe.close()
    return {"shm_first": first * 1e3} | {
        path: statistics.median(values) * 1e3 for path, values in (times | gathers).items()
    }


def undigested_ms(rows: torch.Tensor, repeats: int, evict: Evictor) -> tuple[float, float]:
    """The shared-memory move without its two digests, median ms, warm and cold (as in `transfer_ms`):
    the same copy into a pooled segment, link, open, read into the reader's memory through its kept
    mapping, and removal, to show what the digests cost."""
    raw = (rows.view(torch.int16) if rows.dtype.itemsize == 2 else rows).numpy().reshape(-1).view(np.uint8)
    segment = shm_pool.PooledSegment.create(shared_memory.SHM_DIR, len(raw))
    maps = shm_segment_maps.SegmentMaps(shared_memory.SHM_DIR)

    def move() -> float:
        name = shared_memory.new_name(shared_memory.SEGMENT_PREFIX)
        start = time.perf_counter()
        np.copyto(np.frombuffer(segment.mapping, dtype=np.uint8, count=len(raw)), raw)
        segment.link(name)
        opened = maps.open(name)
        with opened:
            assert opened.read_into(0, np.empty(len(raw), dtype=np.uint8))
        shared_memory.remove(shared_memory.SHM_DIR, name)
        return time.perf_counter() - start

    def cold() -> float:
        evict()
        return move()

    move(), move()
    warm = statistics.median([move() for _ in range(2 * repeats + 1)]) * 1e3
    cold_ms = statistics.median([cold() for _ in range(2 * repeats + 1)]) * 1e3
    maps.close()
    segment.close()
    return warm, cold_ms


def copy_gbps(num_bytes: int, repeats: int = 20) -> float:
    source = np.frombuffer(os.urandom(num_bytes), np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return num_bytes / min(times) / 1e9


def take(data: bytes, context: object) -> bytes:
    """The carried path's second leg: the decoder's receipt of a Generate request, and no more."""
    request = decoder_pb2.GenerateRequest.FromString(data)
    tensors.decode(request.prompt[0].embeddings, rank=2, limits=tensors.TensorLimits(MAX_MESSAGE_BYTES))
    return b""


async def start_sink() -> tuple[object, str]:
    handler = grpc.method_handlers_generic_handler(
        "bench.Sink", {"Take": grpc.unary_unary_rpc_method_handler(take)}
    )
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def start_encoder(embedder: LookupEmbedder, model_dir: Path, shm_dir: Path) -> tuple[object, object]:
    config = EncoderConfig(
        model_dir=model_dir,
        max_input_tokens=8192,
        max_batch_wait_ms=0.0,
        shared_memory_dir=shm_dir,
        server=ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
    )
    servicer = EncoderServicer(config)
    servicer.attach(embedder)
    server = await start_server(config.server, [servicer.service()])
    await server.set_serving()
    return server, servicer


async def handoff(args: argparse.Namespace, model_dir: Path) -> list[dict[str, object]]:
    smol = LookupEmbedder.load(model_dir, torch.bfloat16)
    wide = LookupEmbedder(torch.randn(1024, 4096).to(torch.bfloat16), smol.tokenizer)
    elsewhere = Path(tempfile.mkdtemp(prefix="tandem-bench-other-host-"))
    sink_server, sink_address = await start_sink()
    evict = Evictor()
    rows_out = []
    for name, num_rows, hidden in SPANS:
        embedder = wide if hidden == 4096 else smol
        servers = {}
        for where in ("here", "elsewhere"):
            servers[where] = await start_encoder(
                embedder, model_dir, Path("/dev/shm") if where == "here" else elsewhere
            )
        links = {
            "bytes": EncoderParts(servers["elsewhere"][0].address, torch.bfloat16, MAX_MESSAGE_BYTES, 0),
            "shm": EncoderParts(servers["here"][0].address, torch.bfloat16, MAX_MESSAGE_BYTES, 0),
        }
        client = EncoderClient(servers["here"][0].address, MAX_MESSAGE_BYTES)
        sink = grpc.aio.insecure_channel(
            sink_address,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        take = sink.unary_unary("/bench.Sink/Take")
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        wire: dict[str, int] = {}
        generator = np.random.default_rng(0)
        for repeat in range(args.repeats + 1):  # the first round warms up
            order = PATHS[repeat % 3 :] + PATHS[: repeat % 3]
            for path in order:
                ids = generator.integers(0, embedder.info.vocab_size, num_rows).tolist()
                start = time.perf_counter()
                if path == "carried":
                    reply = await client.embed(token_ids=ids)
                    request = decoder_pb2.GenerateRequest(
                        prompt=[decoder_pb2.PromptSegment(embeddings=reply.embeddings)]
                    )
                    data = request.SerializeToString()
                    await take(data)
                    wire[path] = reply.ByteSize() + len(data)
                else:
                    link = links[path]
                    part = EncoderPrompt("token_ids", ids)
                    rows = await link._rows(part, "prompt[0].encoder", 60.0, ())
                    assert rows.shape == (num_rows, hidden)
                    wire[path] = (
                        num_rows * hidden * 2 + 5 * num_rows if path == "bytes" else 5 * num_rows
                    )  # the reply's rows (bytes only) and the IDs sent
                elapsed = time.perf_counter() - start
                if repeat:
                    times[path].append(elapsed)
        assert links["shm"].num_shared and not links["bytes"].num_shared, "shm used only when co-located"
        num_bytes = num_rows * hidden * 2
        copy = copy_gbps(num_bytes)
        span_rows = torch.randn(num_rows, hidden).to(torch.bfloat16)
        # One intra-op thread for the moves: the gathers' second thread, waited for on these shared cores
        # (a 4.7 MB gather took 10 ms on two threads at load 4, 0.5 ms on one), would time the load.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        moved = transfer_ms(span_rows, args.repeats, evict)
        undigested, undigested_cold = undigested_ms(span_rows, args.repeats, evict)
        torch.set_num_threads(threads)
        dram = copy_gbps(DRAM_COPY_BYTES, repeats=3)  # beside the moves: the load changes by the minute
        row = {
            "span": name,
            "rows": num_rows,
            "hidden": hidden,
            "megabytes": num_bytes / 1e6,
            "copy_gbps": copy,
            "dram_copy_gbps": dram,
            **{f"{path}_ms": statistics.median(times[path]) * 1e3 for path in PATHS},
            **{f"{path}_grpc_mb": wire[path] / 1e6 for path in PATHS},
            "shm_transfer_ms": moved["shm"],
            "shm_cold_transfer_ms": moved["shm_cold"],
            "shm_written_transfer_ms": moved["shm_written"],
            "shm_written_cold_transfer_ms": moved["shm_written_cold"],
            "shm_written_two_pass_transfer_ms": moved["shm_written_two_pass"],
            "shm_written_two_pass_cold_transfer_ms": moved["shm_written_two_pass_cold"],
            "read_two_pass_ms": moved["read_two_pass"],
            "read_fused_ms": moved["read_fused"],
            "gather_into_segment_ms": moved["gather"],
            "gather_fresh_ms": moved["gather_fresh"],
            "shm_first_transfer_ms": moved["shm_first"],
            "bytes_transfer_ms": moved["bytes"],
            "digest_ms": moved["digest"],
            "shm_undigested_ms": undigested,
            "shm_cold_undigested_ms": undigested_cold,
        }
        for key in (
            *("shm_transfer", "shm_cold_transfer", "shm_written_transfer", "shm_written_cold_transfer"),
            *("shm_written_two_pass_transfer", "shm_written_two_pass_cold_transfer"),
            *("shm_undigested", "shm_cold_undigested"),
        ):
            row[f"{key}_gbps"] = num_bytes / row[f"{key}_ms"] / 1e6
        row["shm_share_of_copy"] = row["shm_transfer_gbps"] / copy
        row["shm_share_of_dram_copy"] = row["shm_transfer_gbps"] / dram
        row["shm_cold_share_of_dram_copy"] = row["shm_cold_transfer_gbps"] / dram
        row["shm_written_share_of_dram_copy"] = row["shm_written_transfer_gbps"] / dram
        row["shm_written_cold_share_of_dram_copy"] = row["shm_written_cold_transfer_gbps"] / dram
        row["shm_written_two_pass_share_of_dram_copy"] = row["shm_written_two_pass_transfer_gbps"] / dram
        rows_out.append(row)
        print(
            f"{name:24s} {num_bytes / 1e6:7.2f} MB | carried {row['carried_ms']:7.2f} ms "
            f"{row['carried_grpc_mb']:6.2f} MB | bytes {row['bytes_ms']:7.2f} ms "
            f"{row['bytes_grpc_mb']:6.2f} MB | "
            f"shm {row['shm_ms']:7.2f} ms {row['shm_grpc_mb']:6.3f} MB || the move alone: bytes "
            f"{moved['bytes']:6.2f} ms, shm {moved['shm']:6.2f} ms = {row['shm_transfer_gbps']:5.2f} GB/s, "
            f"{100 * row['shm_share_of_dram_copy']:3.0f} % of a 256 MiB copy ({dram:5.2f} GB/s), "
            f"{100 * row['shm_share_of_copy']:3.0f} % of a same-size copy ({copy:5.2f} GB/s); cold "
            f"{moved['shm_cold']:6.2f} ms = {row['shm_cold_transfer_gbps']:5.2f} GB/s, "
            f"{100 * row['shm_cold_share_of_dram_copy']:3.0f} %; first {moved['shm_first']:6.2f} ms; "
            f"one digest {moved['digest']:5.2f} ms; without the digests {undigested:5.2f} ms = "
            f"{row['shm_undigested_gbps']:5.2f} GB/s, cold {undigested_cold:5.2f} ms || written straight "
            f"in: {moved['shm_written']:6.2f} ms = {row['shm_written_transfer_gbps']:5.2f} GB/s, "
            f"{100 * row['shm_written_share_of_dram_copy']:3.0f} %; cold {moved['shm_written_cold']:6.2f} "
            f"ms, {100 * row['shm_written_cold_share_of_dram_copy']:3.0f} %; its gather "
            f"{moved['gather']:5.2f} ms (into memory of its own {moved['gather_fresh']:5.2f}) || the "
            f"reader's two passes before: {moved['shm_written_two_pass']:6.2f} ms, "
            f"{100 * row['shm_written_two_pass_share_of_dram_copy']:3.0f} %; cold "
            f"{moved['shm_written_two_pass_cold']:6.2f} ms | the read alone: two passes "
            f"{moved['read_two_pass']:5.3f} ms, fused {moved['read_fused']:5.3f} ms",
            flush=True,
        )
        await client.close()
        await sink.close()
        for link in links.values():
            await link.close()
        for server, servicer in servers.values():
            await server.stop(0)
            servicer.close()
    await sink_server.stop(0)
    return rows_out


async def ttft(args: argparse.Namespace, model_dir: Path) -> list[dict[str, object]]:
    smol = LookupEmbedder.load(model_dir, torch.bfloat16)
    elsewhere = Path(tempfile.mkdtemp(prefix="tandem-bench-other-host-"))
    encoders = {
        where: await start_encoder(smol, model_dir, Path("/dev/shm") if where == "here" else elsewhere)
        for where in ("here", "elsewhere")
    }
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype="bfloat16",
            enable_prefix_caching=False,
            max_num_batched_tokens=8192,
            max_model_len=8192,
            num_kv_blocks=600,
        )
    ).start()
    decoders = {}
    for path, where in (("carried", None), ("bytes", "elsewhere"), ("shm", "here")):
        parts = (
            None
            if where is None
            else EncoderParts(encoders[where][0].address, torch.bfloat16, MAX_MESSAGE_BYTES, cache_bytes=0)
        )
        servicer = DecoderServicer("smollm2", MAX_MESSAGE_BYTES, engine=engine, encoder_parts=parts)
        server = await start_server(
            ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
            [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
        )
        await server.set_serving()
        decoders[path] = (server, parts, DecoderClient(server.address, MAX_MESSAGE_BYTES))
    client = EncoderClient(encoders["here"][0].address, MAX_MESSAGE_BYTES)
    generator = np.random.default_rng(1)
    out = []
    for num_rows in args.ttft_rows:
        results: dict[str, dict[str, list[float]]] = {p: {"server": [], "client": []} for p in PATHS}
        for repeat in range(args.ttft_repeats + 1):
            order = PATHS[repeat % 3 :] + PATHS[: repeat % 3]
            for path in order:
                ids = generator.integers(0, smol.info.vocab_size, num_rows).tolist()
                decoder = decoders[path][2]
                start = time.perf_counter()
                if path == "carried":
                    segment = (await client.embed(token_ids=ids)).embeddings
                else:
                    segment = EncoderPart(token_ids=ids)
                first = None
                async for response in decoder.generate([segment], max_new_tokens=1, temperature=0):
                    if response.HasField("delta") and first is None:
                        first = time.perf_counter() - start
                    if response.HasField("finished"):
                        server_ttft = response.finished.time_to_first_token_s
                if repeat:
                    results[path]["server"].append(server_ttft)
                    results[path]["client"].append(first)
        row = {"rows": num_rows}
        for path in PATHS:
            row[f"{path}_client_ms"] = statistics.median(results[path]["client"]) * 1e3
            row[f"{path}_server_ms"] = statistics.median(results[path]["server"]) * 1e3
        out.append(row)
        print(
            f"TTFT n={num_rows:5d} | client wall: "
            + " ".join(f"{p} {row[f'{p}_client_ms']:8.1f} ms" for p in PATHS)
            + " | decoder's: "
            + " ".join(f"{p} {row[f'{p}_server_ms']:8.1f} ms" for p in PATHS),
            flush=True,
        )
    await client.close()
    for server, parts, decoder in decoders.values():
        await decoder.close()
        await server.stop(0)
        if parts is not None:
            await parts.close()
    engine.shutdown()
    for server, servicer in encoders.values():
        await server.stop(0)
        servicer.close()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument(
        "--ttft-rows", type=lambda s: [int(n) for n in s.split(",")], default=[128, 1024, 4096, 8190]
    )
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir = resolve_model(None, "bfloat16")
    args.dram_copy_gbps = copy_gbps(DRAM_COPY_BYTES, repeats=5)
    report: dict[str, object] = {
        "machine": machine(),
        "loadavg_start": os.getloadavg(),
        "dram_copy_gbps": args.dram_copy_gbps,
    }
    print(json.dumps(report), flush=True)
    report["handoff"] = await handoff(args, model_dir)
    if not args.skip_ttft:
        report["ttft"] = await ttft(args, model_dir)
    report["loadavg_end"] = os.getloadavg()
    print(json.dumps({"loadavg_end": report["loadavg_end"]}), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
