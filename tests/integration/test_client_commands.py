"""`tandem embed` and `tandem generate` against live services: the terminal summary, the files, and
prompts whose parts are embeddings, each compared with the same call made through the stubs."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.tests.ports import free_port
from tandem import cli
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, tensor_pb2
from tandem.common.torch_part import tensors
from tandem.decoder.models.loader import LoadedModel
from tests.integration.reliability.harness import Services


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> Iterator[Services]:
    running = Services(tiny_model_dir, tiny_fp32)
    yield running
    running.close()


def _embed_rows(services: Services, request: encoder_pb2.EmbedRequest) -> tuple[torch.Tensor, list[int]]:
    """The reference: the Embed RPC through the stub."""
    reply = services.encoder.Embed(request, timeout=10)
    return tensors.decode(reply.embeddings).clone(), list(reply.token_ids.ids)


def _greedy_text(services: Services, prompt: list[decoder_pb2.PromptSegment], max_new_tokens: int) -> str:
    request = decoder_pb2.GenerateRequest(prompt=prompt)
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = max_new_tokens
    request.stopping.ignore_eos = True
    return "".join(
        r.delta.text for r in services.decoder.Generate(request, timeout=30) if r.HasField("delta")
    )


def _tandem(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _generated(out: str) -> str:
    """The streamed text of `tandem generate`, without its closing [FINISH_REASON...] line."""
    text, _, summary = out.rstrip("\n").rpartition("\n")
    assert re.fullmatch(r"\[FINISH_REASON_LENGTH; \d+ tokens; ttft \d+\.\d+s\]", summary), out
    return text


def test_embed_prints_a_summary_of_the_rows(services: Services, capsys, environ) -> None:
    rows, ids = _embed_rows(services, encoder_pb2.EmbedRequest(text="the quiet harbour"))
    out = _tandem(
        capsys, "embed", "--address", services.encoder_server.address, "--text", "the quiet harbour"
    )
    norms = rows.norm(dim=-1)
    assert out.splitlines() == [
        f"embeddings [{len(ids)}, 64] float32 from {len(ids)} tokens",
        f"token IDs: {', '.join(map(str, ids))}",
        f"row norms: min {norms.min():.4f}, mean {norms.mean():.4f}, max {norms.max():.4f}",
        f"row 0: [{', '.join(f'{v:.4f}' for v in rows[0, :6].tolist())}, ...]",
    ]


def test_embed_writes_npy_and_safetensors_files_holding_the_rows(
    services: Services, tmp_path: Path, capsys, environ
) -> None:
    address = ["--address", services.encoder_server.address]
    bf16 = encoder_pb2.EmbedRequest(output_dtype=tensor_pb2.DATA_TYPE_BFLOAT16)
    bf16.token_ids.ids.extend([5, 6, 7])
    rows, ids = _embed_rows(services, bf16)
    npy, safetensors = tmp_path / "rows.npy", tmp_path / "rows.safetensors"
    out = _tandem(capsys, "embed", *address, "--ids", "5,6,7", "--dtype", "bfloat16", "--out", str(npy))
    assert out == f"wrote {npy}: embeddings [3, 64] float32\n"  # numpy has no bfloat16
    assert torch.equal(torch.from_numpy(np.load(npy)), rows.float())
    out = _tandem(
        capsys, "embed", *address, "--ids", "5,6,7", "--dtype", "bfloat16", "--out", str(safetensors)
    )
    assert out == f"wrote {safetensors}: embeddings [3, 64] bfloat16\n"
    stored = load_file(safetensors)
    assert torch.equal(stored["embeddings"], rows) and stored["token_ids"].tolist() == ids == [5, 6, 7]
    assert cli.main(["embed", *address, "--ids", "5", "--out", str(tmp_path / "rows.pt")]) == 2
    assert "--out (TANDEM_EMBED_OUT): " in capsys.readouterr().err


def test_generate_from_a_file_of_token_table_rows_says_what_the_token_ids_say(
    services: Services, tmp_path: Path, capsys, environ
) -> None:
    rows_file = tmp_path / "rows.safetensors"
    _tandem(
        capsys,
        "embed",
        "--address",
        services.encoder_server.address,
        "--ids",
        "5,6,7",
        "--out",
        str(rows_file),
    )
    common = [
        "generate",
        "--address",
        services.decoder_server.address,
        "--temperature",
        "0",
        "--max-tokens",
        "6",
    ]
    from_ids = _generated(_tandem(capsys, *common, "--part", "ids:5,6,7"))
    from_file = _generated(_tandem(capsys, *common, "--part", f"file:{rows_file}"))
    # The lookup encoder's float32 rows are the decoder's token table: the same greedy tokens.
    assert (
        from_file
        == from_ids
        == _greedy_text(services, [decoder_pb2.PromptSegment(token_ids={"ids": [5, 6, 7]})], 6)
    )


def test_generate_sends_embed_parts_through_the_encoder_in_order(services: Services, capsys, environ) -> None:
    argv = [
        "generate", "--address", services.decoder_server.address,
        "--encoder-address", services.encoder_server.address,
        "--prompt", "Once", "--part", "embed: upon a time", "--part", "text:,",
        "--temperature", "0", "--max-tokens", "5",
    ]  # fmt: skip
    text = _generated(_tandem(capsys, *argv))
    embedded = services.encoder.Embed(encoder_pb2.EmbedRequest(text=" upon a time"), timeout=10).embeddings
    prompt = [
        decoder_pb2.PromptSegment(text="Once"),
        decoder_pb2.PromptSegment(embeddings=embedded),
        decoder_pb2.PromptSegment(text=","),
    ]
    assert text == _greedy_text(services, prompt, 5)


def test_a_part_that_cannot_be_read_is_one_line_naming_it(services: Services, tmp_path: Path, capsys) -> None:
    argv = [
        "generate",
        "--address",
        services.decoder_server.address,
        "--part",
        f"file:{tmp_path / 'none.npy'}",
    ]
    assert cli.main(argv) == 2
    none = tmp_path / "none.npy"
    assert capsys.readouterr().err == f"tandem generate: --part file:{none}: no such file\n"


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int) -> str:
    """The one line a failed command prints on stderr; nothing on stdout, no traceback, no blank line."""
    assert cli.main(argv) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, (out, err)
    return err.rstrip("\n")


def test_a_value_a_request_cannot_hold_names_its_flag_without_a_traceback(capsys, environ) -> None:
    # `--max-tokens -1` was a 44-line traceback (ValueError: Value out of range: -1).
    for flag, value in [("--max-tokens", "-1"), ("--top-k", "-3"), ("--seed", str(2**64))]:
        err = _one_line_error(capsys, ["generate", "--prompt", "hi", flag, value], 2)
        assert err.startswith(f"tandem generate: {flag} (TANDEM_GENERATE_"), err
    err = _one_line_error(capsys, ["generate", "--part", "ids:1,4294967296"], 2)
    assert err.startswith("tandem generate: --part (TANDEM_GENERATE_PART): 'ids:1,4294967296': token IDs"), (
        err
    )


def test_a_value_the_decoder_refuses_is_one_line_naming_the_flag(services: Services, capsys, environ) -> None:
    decoder = ["generate", "--address", services.decoder_server.address, "--prompt", "hi"]
    err = _one_line_error(capsys, [*decoder, "--max-tokens", "0"], 2)
    assert err == (
        "tandem generate: --max-tokens (TANDEM_GENERATE_MAX_TOKENS): must be >= 1, got 0 "
        "(the request's stopping.max_new_tokens)"
    )
    err = _one_line_error(capsys, [*decoder, "--temperature", "-1"], 2)
    assert err.startswith(
        "tandem generate: --temperature (TANDEM_GENERATE_TEMPERATURE): must be in [0.0, "
    ), err
    err = _one_line_error(capsys, [*decoder, "--part", "ids:5,999999", "--max-tokens", "2"], 2)
    assert err.startswith("tandem generate: --part ids:5,999999: token id 999999 outside [0, "), err
    assert err.endswith("(the request's prompt[1].token_ids.ids[1])"), err


def test_an_unreachable_server_names_the_flag_of_its_address(services: Services, capsys, environ) -> None:
    # The encoder down used to blame `--part`.
    closed = f"127.0.0.1:{free_port()}"  # below the ephemeral range (ports.py)
    argv = ["generate", "--address", services.decoder_server.address, "--encoder-address", closed]
    err = _one_line_error(capsys, [*argv, "--part", "embed: the quiet harbour"], 1)
    assert err.startswith(
        f"tandem generate: --encoder-address (TANDEM_GENERATE_ENCODER_ADDRESS) {closed}: UNAVAILABLE: "
    )
    err = _one_line_error(capsys, ["generate", "--address", closed, "--prompt", "hi"], 1)
    assert err.startswith(f"tandem generate: --address (TANDEM_GENERATE_ADDRESS) {closed}: UNAVAILABLE: "), (
        err
    )
    err = _one_line_error(capsys, ["embed", "--address", closed, "--text", "hi"], 1)
    assert err.startswith(f"tandem embed: --address (TANDEM_EMBED_ADDRESS) {closed}: UNAVAILABLE: "), err


def test_a_value_the_encoder_refuses_is_one_line_naming_the_flag(services: Services, capsys, environ) -> None:
    encoder = ["embed", "--address", services.encoder_server.address]
    err = _one_line_error(capsys, [*encoder, "--ids", "999999"], 2)
    assert err.startswith("tandem embed: --ids (TANDEM_EMBED_IDS): token id 999999 outside [0, "), err


def test_trace_without_an_exporter_says_nothing_is_recorded_and_how_to_record(
    services: Services, capsys, environ, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    argv = ["generate", "--address", services.decoder_server.address, "--prompt", "hi", "--max-tokens", "2"]
    assert cli.main([*argv, "--trace"]) == 0
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"trace id: [0-9a-f]{32}; not recorded here, no exporter is configured: "
        r"OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:4317 sends spans to a collector, "
        r"OTEL_TRACES_EXPORTER=console prints them\n",
        err,
    ), err


def test_an_unreachable_collector_is_one_line_after_the_answer(services: Services, capsys, environ) -> None:
    # It was four exporter messages over 16 s of retries.
    closed = free_port()  # below the ephemeral range (ports.py)
    environ({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed}"})
    argv = ["generate", "--address", services.decoder_server.address, "--prompt", "hi", "--max-tokens", "2"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "[FINISH_REASON_LENGTH; 2 tokens;" in out
    # Both the span and the command's metrics are exported; whichever export fails first is the line.
    failed = rf"tandem generate: telemetry: Failed to export (traces|metrics) to 127\.0\.0\.1:{closed}, "
    assert re.match(failed, err), err
    assert len(err.splitlines()) == 1, err


class _CutShort(decoder_pb2_grpc.DecoderServicer):
    """A decoder that streams some text, then closes the stream OK without its `finished` event."""

    def Generate(self, request, context):  # noqa: N802 (the RPC's name)
        yield decoder_pb2.GenerateResponse(delta=decoder_pb2.TokenDelta(text="Once upon"))


def test_a_stream_closed_without_its_finished_event_is_a_failure_not_an_answer(capsys, environ) -> None:
    # It exited 0 with the text and no summary line: a cut-short answer read as a whole one.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    decoder_pb2_grpc.add_DecoderServicer_to_server(_CutShort(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert cli.main(["generate", "--address", f"127.0.0.1:{port}", "--prompt", "hi"]) == 1
    finally:
        server.stop(0)
    out, err = capsys.readouterr()
    assert out == "Once upon\n", out  # the text so far, its line ended before the error
    assert err == (
        f"tandem generate: --address (TANDEM_GENERATE_ADDRESS) 127.0.0.1:{port}: "
        "the stream ended without its finished event\n"
    ), err
