"""EncoderConfig validation and how flags and TANDEM_ENCODER_* variables become one."""

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.common.server import ServerOptions
from tandem.common.torch_part.model_cache import default_model_file
from tandem.encoder import __main__ as encoder_main
from tandem.encoder.__main__ import config_from_args, main
from tandem.encoder.config import SMALL_FIELDS_BYTES, EncoderConfig
from tandem.encoder.embedder import Pooling

MODEL = Path("/models/tiny")


def test_defaults_serve_the_lookup_embedder_on_port_50051() -> None:
    config = EncoderConfig(model_dir=MODEL)
    assert (config.embedder, config.dtype, config.pooling) == ("lookup", "bfloat16", Pooling.NONE)
    assert config.server.port == 50051
    assert config.served_model_name == "tiny"
    assert EncoderConfig(model_dir=MODEL, model_name="qwen").served_model_name == "qwen"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"embedder": "clip"},
            r"embedder must be one of \('lookup', 'soft-prompt', 'projector'\), got 'clip'",
        ),
        ({"dtype": "int8"}, r"dtype must be one of \('bfloat16', 'float16', 'float32'\), got 'int8'"),
        ({"pooling": "max"}, r"pooling must be one of \['none', 'mean'\], got 'max'"),
        ({"max_input_tokens": 0}, "max_input_tokens must be >= 1"),
        ({"embedder": "soft-prompt"}, "adapter_dir is required by embedder 'soft-prompt'"),
        ({"embedder": "projector", "projector_path": Path("p")}, "encoder_model_dir is required"),
        ({"embedder": "projector", "encoder_model_dir": Path("e")}, "projector_path is required"),
        ({"adapter_dir": Path("a")}, "adapter_dir is only used by embedder 'soft-prompt', not 'lookup'"),
        ({"embedder": "soft-prompt", "adapter_dir": Path("a"), "projector_path": Path("p")}, "only used"),
        ({"quantization": "gguf"}, r"quantization must be one of \('none', 'int8', 'int4'\)"),
        # Every Embed reply carries it, in room kept for at most this much (request.py)
        ({"model_name": "é" * 129}, "model_name must be at most 256 bytes of UTF-8 .* got 258"),
        # Logged and listed as the decoder's is: a newline forged a log line, a trailing space a twin
        ({"model_name": "tiny\nERROR forged"}, "model_name must not hold control characters"),
        ({"model_name": "tiny "}, "model_name must not"),
        (
            {
                "quantization": "int8",
                "embedder": "projector",
                "projector_path": Path("p"),
                "encoder_model_dir": Path("e"),
            },
            "not used by embedder 'projector'",
        ),
    ],
)
def test_invalid_configs_are_refused_when_built(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EncoderConfig(model_dir=MODEL, **kwargs)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("max_image_pixels", 0, "must be >= 1, got 0"),
        ("max_batch_size", 0, "must be >= 1, got 0"),
        ("shared_memory_segments", 0, "must be >= 1, got 0"),
        ("shared_memory_bytes", -1, "must be >= 0 (0: never), got -1"),
        ("shared_memory_lease_s", 0.09, "must be in [0.1, 3600] seconds, got 0.09"),
        ("shared_memory_lease_s", 3600.5, "must be in [0.1, 3600] seconds, got 3600.5"),
        ("max_batch_wait_ms", -0.5, "must be in [0, 1000], got -0.5"),
        ("max_batch_wait_ms", 1000.5, "must be in [0, 1000], got 1000.5"),
    ],
)
def test_a_bound_past_its_limit_is_refused_naming_the_field_and_the_limit(
    field: str, value: float, reason: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        EncoderConfig(model_dir=MODEL, **{field: value})
    assert (refused.value.field, refused.value.reason) == (field, reason)


@pytest.mark.parametrize(
    "limits",
    [
        {
            "max_input_tokens": 1,
            "max_image_pixels": 1,
            "max_batch_size": 1,
            "shared_memory_segments": 1,
            "shared_memory_bytes": 0,
            "shared_memory_lease_s": 0.1,
            "max_batch_wait_ms": 0,
        },
        {"shared_memory_lease_s": 3600, "max_batch_wait_ms": 1000},
    ],
)
def test_each_bound_at_its_limit_is_taken(limits: dict) -> None:
    config = EncoderConfig(model_dir=MODEL, **limits)
    assert {field: getattr(config, field) for field in limits} == limits


def test_flags_build_the_config(environ) -> None:
    argv = [
        "--model", "/m", "--embedder", "projector", "--encoder-model", "/e", "--projector", "/p.safetensors",
        "--pooling", "mean", "--dtype", "float32", "--max-input-tokens", "256", "--model-name", "m1",
        "--host", "0.0.0.0", "--port", "6000", "--max-message-bytes", "2048", "--grace-s", "0.5",
    ]  # fmt: skip
    config = config_from_args(argv)
    assert config.model_dir == Path("/m") and config.model_name == "m1"
    assert config.encoder_model_dir == Path("/e") and config.projector_path == Path("/p.safetensors")
    assert (config.embedder, config.pooling, config.dtype, config.max_input_tokens) == (
        "projector",
        Pooling.MEAN,
        "float32",
        256,
    )
    server = config.server
    assert (server.host, server.port, server.max_message_bytes) == ("0.0.0.0", 6000, 2048)
    assert server.grace_s == 0.5


def test_environment_fills_flags_not_given_and_flags_win(environ) -> None:
    environ(
        {
            "TANDEM_ENCODER_MODEL": "/env-model",
            "TANDEM_ENCODER_EMBEDDER": "soft-prompt",
            "TANDEM_ENCODER_ADAPTER": "/adapter",
            "TANDEM_ENCODER_PORT": "7000",
            "TANDEM_ENCODER_MAX_INPUT_TOKENS": "99",
        }
    )
    config = config_from_args(["--port", "7001"])
    assert config.model_dir == Path("/env-model") and config.adapter_dir == Path("/adapter")
    assert (config.embedder, config.max_input_tokens, config.server.port) == ("soft-prompt", 99, 7001)


def test_without_a_model_the_encoder_serves_the_decoders_default_model(environ) -> None:
    config = config_from_args([])
    assert config.model_dir == default_model_file()
    assert config.served_model_name == "SmolLM2-135M-Instruct"


def test_an_empty_model_name_is_refused_rather_than_read_as_the_directorys(environ, capsys) -> None:
    """As the decoder's: it served under the directory's name while the operator asked for none."""
    assert main(["--model", "/models/tiny", "--model-name", ""]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --model-name (TANDEM_ENCODER_MODEL_NAME) must name a model, got '' (leave "
        "the flag out for the directory's or file's name)\n"
    )
    environ({"TANDEM_ENCODER_MODEL_NAME": ""})  # an empty variable is unset, as every variable
    assert config_from_args(["--model", "/models/tiny"]).model_name == "tiny"


@pytest.mark.parametrize(
    ("model", "name"), [("/models/My Model ", "'My Model '"), (".", "''"), ("/x/..", "'..'")]
)
def test_a_directorys_name_that_cannot_be_served_is_one_line_naming_model_not_model_name(
    model: str, name: str, environ, capsys
) -> None:
    assert main(["--model", model]) == 2
    said = capsys.readouterr().err
    assert said.startswith(
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): the directory's name {name} cannot be served"
    )
    assert said.endswith("): give --model-name\n") and said.count("\n") == 1


def test_bad_values_are_one_line_naming_the_flag_and_the_variable(environ, capsys) -> None:
    environ({"TANDEM_ENCODER_PORT": "http"})
    assert main(["--model", "/m"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --port (TANDEM_ENCODER_PORT): 'http' is not a valid integer.\n"
    )
    environ({"TANDEM_ENCODER_PORT": "50051"})
    assert main(["--model", "/m", "--model-name", "n" * 3500]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --model-name (TANDEM_ENCODER_MODEL_NAME) must be at most 256 bytes of UTF-8 "
        "(the longest `model` a request may name), got 3500\n"
    )
    # A byte 0xff, surrogate-escaped: in the flag (every text flag's own check), or in the directory's
    # name the flag defaults to (refused naming --model, the flag that gave it).
    assert main(["--model", "/m", "--model-name", "n\udcff"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --model-name (TANDEM_ENCODER_MODEL_NAME): is not UTF-8 text\n"
    )
    assert main(["--model", "/m\udcff"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --model (TANDEM_ENCODER_MODEL): the directory's name 'm\\udcff' cannot be "
        "served as a model name (a model name must be valid UTF-8): give --model-name\n"
    )
    environ({"TANDEM_ENCODER_PORT": "50051", "TANDEM_ENCODER_MAX_INPUT_TOKENS": "0"})
    assert main(["--model", "/m"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --max-input-tokens (TANDEM_ENCODER_MAX_INPUT_TOKENS) must be >= 1, got 0\n"
    )
    assert main(["--model", "/m", "--embedder", "clip"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem serve encoder: --embedder (TANDEM_ENCODER_EMBEDDER): 'clip' is not one of")
    assert err.count("\n") == 1


def test_the_image_bound_defaults_to_20_mib_or_to_what_a_message_carries_beside_the_other_fields() -> None:
    assert EncoderConfig(model_dir=MODEL).image_bytes_limit == 20 * 1024 * 1024
    small = EncoderConfig(model_dir=MODEL, server=ServerOptions(max_message_bytes=1024 * 1024))
    assert small.image_bytes_limit == 1024 * 1024 - SMALL_FIELDS_BYTES
    assert EncoderConfig(model_dir=MODEL, max_image_bytes=1000).image_bytes_limit == 1000


def test_an_image_bound_no_message_could_carry_is_refused_at_start_up_naming_both_flags(
    environ, capsys
) -> None:
    # An image between the two bounds got gRPC's own RESOURCE_EXHAUSTED, naming no field or flag.
    argv = [
        "--model",
        "/m",
        "--max-image-bytes",
        str(2 * 1024 * 1024),
        "--max-message-bytes",
        str(1024 * 1024),
    ]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --max-image-bytes (TANDEM_ENCODER_MAX_IMAGE_BYTES) 2097152 cannot travel "
        "within --max-message-bytes 1048576 (an Embed request carries up to 65536 bytes of other fields): "
        "raise --max-message-bytes to 2162688 or lower --max-image-bytes to 983040\n"
    )
    fits = 1024 * 1024 - SMALL_FIELDS_BYTES
    config = config_from_args(
        ["--model", "/m", "--max-image-bytes", str(fits), "--max-message-bytes", "1048576"]
    )
    assert config.image_bytes_limit == fits
    with pytest.raises(ValueError, match="max_image_bytes must be >= 1, got 0"):
        EncoderConfig(model_dir=MODEL, max_image_bytes=0)


def test_messages_with_no_room_for_an_image_are_refused_at_start_up_for_a_checkpoint_that_takes_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default bound, min(20 MiB, max_message_bytes - 64 KiB), was 0 here: every image was refused.
    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text('{"architectures": ["LlavaForConditionalGeneration"]}')
    argv = ["--model", str(llava), "--port", "0", "--max-message-bytes", str(SMALL_FIELDS_BYTES)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --max-message-bytes (TANDEM_ENCODER_MAX_MESSAGE_BYTES) 65536 leaves no room "
        "for an image (this checkpoint takes images, and an Embed request carries up to 65536 bytes of "
        "other fields beside one): raise --max-message-bytes above 65536, to 21037056 for the default "
        "--max-image-bytes of 20971520\n"
    )
    one_byte = EncoderConfig(model_dir=llava, server=ServerOptions(max_message_bytes=SMALL_FIELDS_BYTES + 1))
    one_byte.check_room_for_images()
    assert one_byte.image_bytes_limit == 1


def test_a_text_checkpoint_keeps_messages_of_64_kib_or_less(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[EncoderConfig] = []

    async def serve(config: EncoderConfig, tokenizer: object = None) -> bool:
        served.append(config)
        return True

    monkeypatch.setattr(encoder_main, "serve", serve)  # past every start-up check: it would listen
    assert main(["--model", str(tiny_model), "--port", "0", "--max-message-bytes", "4096"]) == 0
    assert [config.server.max_message_bytes for config in served] == [4096]


def test_an_explicit_image_bound_with_messages_too_small_for_any_image_says_only_what_can_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--model", "/m", "--max-image-bytes", "1", "--max-message-bytes", "4096"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve encoder: --max-image-bytes (TANDEM_ENCODER_MAX_IMAGE_BYTES) 1 cannot travel within "
        "--max-message-bytes 4096 (an Embed request carries up to 65536 bytes of other fields): raise "
        "--max-message-bytes to 65537\n"
    )


def test_an_unsupported_vision_language_checkpoint_is_one_line_naming_what_is_supported(
    tmp_path: Path,
) -> None:
    import json

    from tandem.encoder.embedder import EmbedderLoadError
    from tandem.encoder.loader import load_embedder

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {}})
    )
    with pytest.raises(EmbedderLoadError) as error:
        load_embedder(EncoderConfig(model_dir=tmp_path))
    message = str(error.value)
    assert "'Qwen2VLForConditionalGeneration' is not supported" in message and "\n" not in message
    assert "LlavaForConditionalGeneration" in message and "Idefics3ForConditionalGeneration" in message


def test_the_lookup_embedder_on_a_llava_checkpoint_serves_its_images(tmp_path: Path) -> None:
    from services.encoder.tests.vision_checkpoints import make_llava
    from tandem.encoder.loader import load_embedder
    from tandem.encoder.vision.embedder import VisionLanguageEmbedder

    embedder = load_embedder(EncoderConfig(model_dir=make_llava(tmp_path / "llava")))
    assert isinstance(embedder, VisionLanguageEmbedder) and embedder.info.image_placeholder == "<image>"


def test_an_embedders_path_missing_or_of_the_wrong_kind_is_refused_before_listening_naming_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found only by the load, after the server listened (exit 1), a file given for the adapter's
    # directory said not to exist.
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    a_file, missing = text / "config.json", tmp_path / "missing"
    start = ["--model", str(text), "--port", "0"]
    for argv, said in (
        (
            ["--embedder", "soft-prompt", "--adapter", str(a_file)],
            f"--adapter (TANDEM_ENCODER_ADAPTER): {a_file} is not a directory",
        ),
        (
            ["--embedder", "soft-prompt", "--adapter", str(missing)],
            f"--adapter (TANDEM_ENCODER_ADAPTER): {missing} does not exist",
        ),
        (
            ["--embedder", "projector", "--encoder-model", str(missing), "--projector", str(a_file)],
            f"--encoder-model (TANDEM_ENCODER_ENCODER_MODEL): {missing} does not exist",
        ),
        (
            ["--embedder", "projector", "--encoder-model", str(text), "--projector", str(text)],
            f"--projector (TANDEM_ENCODER_PROJECTOR): {text} is not a file",
        ),
    ):
        assert main(start + argv) == 2, argv
        assert capsys.readouterr().err == f"tandem serve encoder: {said}\n"
