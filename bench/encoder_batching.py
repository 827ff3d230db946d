"""The encoder's batching of image Embed calls (issue 33): images/s and rows/s at 1 and 8 concurrent
callers, batched (`--max-batch-size 8`) against one call at a time (`--max-batch-size 1`), and
transformers' own LLaVA image path (its processor, then `get_image_features`) in the same run.

The checkpoint is a random LLaVA written by transformers with a realistic tower, SigLIP-B/16 at
224 px (86M parameters, 196 rows an image), and a tiny language model the encoder never reads. The
encoder runs in this process behind a real gRPC server on loopback (the client's work shares the
cores, as a co-located caller's would); each run embeds `--images` JPEGs of 640 x 480 after two warm
calls. Subjects run interleaved, the order rotating per repeat, and the median of `--repeats` (3) is
printed. Nothing is asserted: it prints the CPU and one markdown table.

Run: `.venv/bin/python bench/encoder_batching.py [--images 32] [--repeats 3] [--dtype bfloat16]`
(about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.encoder.tests.vision_checkpoints import make_llava  # noqa: E402
from tandem.client.client import EncoderClient  # noqa: E402
from tandem.common.server import ServerOptions, start_server  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.encoder.config import EncoderConfig  # noqa: E402
from tandem.encoder.servicer import EncoderServicer  # noqa: E402
from tandem.encoder.vision.embedder import VisionLanguageEmbedder  # noqa: E402

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def make_checkpoint(out_dir: Path) -> Path:
    """A random LLaVA with a SigLIP-B/16 tower at 224 px and a one-layer language model (never run)."""
    siglip_b16 = dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224,
        patch_size=16,
    )  # fmt: skip
    text = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    return make_llava(out_dir, tower="siglip", strategy="full", vision_sizes=siglip_b16, text_sizes=text)


def pictures(count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


async def run_encoder(
    model_dir: Path, images: list[bytes], batch_size: int, callers: int, dtype: str
) -> dict:
    config = EncoderConfig(
        model_dir=model_dir,
        dtype=dtype,
        max_batch_size=batch_size,
        server=ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
    )
    servicer = EncoderServicer(config)
    server = await start_server(config.server, [servicer.service()])
    # Loaded on the worker thread that will run it, as `tandem serve encoder` does.
    servicer.attach(await servicer.on_worker(VisionLanguageEmbedder.load, model_dir, getattr(torch, dtype)))
    await server.set_serving()
    client = EncoderClient(server.address, MAX_MESSAGE_BYTES)
    try:
        for data in images[:2]:
            await client.embed(image=data, timeout=600)
        queue = list(images)
        rows = 0
        latencies = []

        async def caller() -> None:
            nonlocal rows
            while queue:
                data = queue.pop()
                start = time.perf_counter()
                reply = await client.embed(image=data, timeout=600)
                latencies.append(time.perf_counter() - start)
                rows += reply.embeddings.shape[0]

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        elapsed = time.perf_counter() - start
        sizes = servicer._batcher.batch_sizes[2:] if servicer._batcher else []
    finally:
        await client.close()
        await server.stop(0)
        servicer.close()
    return {
        "images/s": len(images) / elapsed,
        "rows/s": rows / elapsed,
        "latency": float(np.median(latencies)),
        "batch": float(np.mean(sizes)) if sizes else 1.0,
    }


def transformers_runner(model_dir: Path, dtype: torch.dtype) -> Callable[[list[bytes], int], dict]:
    """transformers' image path, loaded once: its processor, then get_image_features, `batch` at a time."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    processor = AutoProcessor.from_pretrained(model_dir)

    def features(chunk: list[bytes]) -> int:
        pixels = processor.image_processor([Image.open(io.BytesIO(d)) for d in chunk], return_tensors="pt")
        with torch.inference_mode():
            out = model.get_image_features(pixel_values=pixels["pixel_values"].to(dtype))
        out = getattr(out, "pooler_output", out)
        parts = out if isinstance(out, list | tuple) else [out]
        return sum(o.reshape(-1, o.shape[-1]).shape[0] for o in parts)

    def run(images: list[bytes], batch: int) -> dict:
        features(images[:batch])  # warm
        start = time.perf_counter()
        rows = sum(features(images[i : i + batch]) for i in range(0, len(images), batch))
        elapsed = time.perf_counter() - start
        latency = elapsed / len(images) * batch
        return {
            "images/s": len(images) / elapsed,
            "rows/s": rows / elapsed,
            "latency": latency,
            "batch": batch,
        }

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is printed")
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}], {torch.get_num_threads()} threads, dtype {args.dtype}")
    images = pictures(args.images)
    subjects = [(f"Tandem encoder, --max-batch-size {b}", c) for b in (1, 8) for c in (1, 8)]
    subjects += [(f"transformers processor + get_image_features, batch {b}", "-") for b in (1, 8)]
    runs: dict[tuple[str, object], list[dict]] = {subject: [] for subject in subjects}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = make_checkpoint(Path(folder) / "llava-siglip-b16")
        torch_dtype = getattr(torch, args.dtype)
        reference = transformers_runner(model_dir, torch_dtype)
        for repeat in range(args.repeats):  # interleaved, the order rotating, as the harness does
            order = subjects[repeat % len(subjects) :] + subjects[: repeat % len(subjects)]
            for name, callers in order:
                if name.startswith("Tandem"):
                    batch_size = int(name.rsplit(" ", 1)[1])
                    result = asyncio.run(run_encoder(model_dir, images, batch_size, int(callers), args.dtype))
                else:
                    result = reference(images, int(name.rsplit(" ", 1)[1]))
                runs[(name, callers)].append(result)
    rows = []
    for name, callers in subjects:
        done = runs[(name, callers)]
        median = {key: float(np.median([r[key] for r in done])) for key in done[0]}
        rows.append((name, callers, median))
    print()
    print("| subject | callers | images/s | rows/s | median latency (s) | mean batch |")
    print("|---|---|---|---|---|---|")
    for name, callers, r in rows:
        figures = f"{r['images/s']:.2f} | {r['rows/s']:.0f} | {r['latency']:.3f} | {r['batch']:.1f}"
        print(f"| {name} | {callers} | {figures} |")
    rate = [r["images/s"] for _, _, r in rows]
    print(f"\nbatched / one at a time, 8 callers: {rate[3] / rate[1]:.2f}x")
    print(f"batched encoder, 8 callers / transformers batch 8: {rate[3] / rate[5]:.2f}x")
    print(f"encoder, 1 caller / transformers batch 1: {rate[0] / rate[4]:.2f}x")


if __name__ == "__main__":
    main()
