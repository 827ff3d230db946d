"""Embedding transport: how fast [n, hidden] bf16 rows move as `tandem.v1.Tensor` messages.

Two measures, per row count (`TRANSPORT_ROWS`, hidden 512 for bench-small, so 0.13 to 8.4 MB):
- the codec alone: `tandem.common.torch_part.tensors.encode` (tensor -> message, one copy), protobuf
  serialize + parse (the bytes a channel carries), `tandem.common.torch_part.tensors.decode` (validation
  and a zero-copy view);
- the encoder's Embed RPC over loopback gRPC against a `python -m tandem.encoder` subprocess: token
  IDs in, [n, hidden] rows out, so the lookup, the server's encode and the client's parse are included.
MB/s is 1e6 bytes of bf16 payload over the median time.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_throughput import make_prompts  # noqa: E402
from grpc_throughput import _free_port, wait_serving  # noqa: E402

from tandem.client.client import EncoderClient  # noqa: E402
from tandem.common.torch_part import tensors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRANSPORT_ROWS = (128, 1024, 4096, 8192)


def codec_rates(hidden_size: int, repeats: int) -> dict[int, dict[str, float]]:
    """MB/s of `tandem.common.torch_part.tensors` encode, protobuf serialize + parse, and decode, per row
    count."""
    out = {}
    for rows in TRANSPORT_ROWS:
        x = torch.randn(rows, hidden_size).to(torch.bfloat16)  # [rows, hidden_size]
        megabytes = x.numel() * x.element_size() / 1e6
        times: dict[str, list[float]] = defaultdict(list)
        for _ in range(max(5, 3 * repeats)):
            t0 = time.perf_counter()
            message = tensors.encode(x)
            t1 = time.perf_counter()
            wire = message.SerializeToString()
            parsed = type(message).FromString(wire)
            t2 = time.perf_counter()
            tensors.decode(parsed, rank=2, last_dim=hidden_size)
            t3 = time.perf_counter()
            times["encode"].append(t1 - t0)
            times["serialize_parse"].append(t2 - t1)
            times["decode"].append(t3 - t2)
        out[rows] = {k: megabytes / statistics.median(v) for k, v in times.items()}
        out[rows]["megabytes"] = megabytes
    return out


async def embed_rpc_rates(address: str, vocab: int, repeats: int) -> dict[int, dict[str, float]]:
    """MB/s of Embed calls returning [n, hidden] bf16 over loopback (lookup and codec included)."""
    out = {}
    async with EncoderClient(address) as client:
        for rows in TRANSPORT_ROWS:
            ids = make_prompts(1, rows, vocab, seed=rows)[0]
            await client.embed(token_ids=ids)  # warm-up
            walls, size = [], 0
            for _ in range(max(5, 3 * repeats)):
                start = time.perf_counter()
                reply = await client.embed(token_ids=ids, timeout=60)
                walls.append(time.perf_counter() - start)
                size = len(reply.embeddings.data)
            out[rows] = {"megabytes": size / 1e6, "mb_per_s": size / 1e6 / statistics.median(walls)}
            out[rows]["median_ms"] = 1e3 * statistics.median(walls)
    return out


def transport_workload(model_dir: Path, hidden_size: int, vocab: int, repeats: int) -> dict:
    """Embed RPC MB/s against a fresh encoder subprocess, then the codec alone."""
    port = _free_port()
    argv = [sys.executable, "-m", "tandem.encoder", "--model", str(model_dir), "--port", str(port)]
    encoder = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_serving(f"127.0.0.1:{port}", encoder, EncoderClient))
        rpc = asyncio.run(embed_rpc_rates(f"127.0.0.1:{port}", vocab, repeats))
    finally:
        encoder.terminate()
        encoder.wait(timeout=60)
    codec = codec_rates(hidden_size, repeats)
    for rows in TRANSPORT_ROWS:
        print(
            f"  transport [{rows}, {hidden_size}] bf16 ({codec[rows]['megabytes']:.2f} MB): encode "
            f"{codec[rows]['encode']:.0f} MB/s, serialize+parse {codec[rows]['serialize_parse']:.0f} MB/s, "
            f"Embed RPC {rpc[rows]['mb_per_s']:.0f} MB/s"
        )
    return {"codec_mb_per_s": codec, "embed_rpc": rpc}
