"""The `model` field: bounded, checked against the served name, never echoed whole."""

import unicodedata
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError, InvalidArgument, NotFound
from tandem.common.model_name import (
    MAX_ECHO_CHARS,
    MAX_MODEL_NAME_BYTES,
    check_adapter_name,
    check_label,
    check_model,
    check_served_name,
    echo,
    served_model_name,
)


def test_empty_or_the_served_name_passes() -> None:
    check_model("", "SmolLM2")
    check_model("SmolLM2", "SmolLM2")


def test_another_name_is_not_found_and_quoted() -> None:
    with pytest.raises(NotFound, match="'gpt-5' is not served here"):
        check_model("gpt-5", "SmolLM2")


def test_a_long_unknown_name_is_echoed_cut_short() -> None:
    name = "m" * MAX_MODEL_NAME_BYTES
    with pytest.raises(NotFound) as caught:
        check_model(name, "SmolLM2")
    assert name not in caught.value.message
    assert f"({MAX_MODEL_NAME_BYTES} characters)" in caught.value.message
    assert len(caught.value.message) < MAX_ECHO_CHARS + 120


def test_a_name_over_the_bound_is_invalid_argument_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_model("é" * (MAX_MODEL_NAME_BYTES // 2 + 1), "SmolLM2")  # 2 bytes each: over in bytes
    assert caught.value.field == "model"
    assert str(MAX_MODEL_NAME_BYTES) in caught.value.description


def test_echo_keeps_short_text_whole() -> None:
    assert echo("abc") == "'abc'"


@pytest.mark.parametrize(
    "name",
    ["qv4\nINFO forged line", "a\x00b", "a\x7fb", "a\u2028b", "a\u2029b", " ", "qv4 ", " qv4", "\tqv4"],
)
def test_an_adapter_name_with_control_characters_or_outer_white_space_is_refused(name: str) -> None:
    # Names are logged as they are and stand for an OpenAI model: "qv4 " beside "qv4" is a second
    # adapter nobody can tell from the first.
    with pytest.raises(InvalidArgument) as caught:
        check_adapter_name(name, "name")
    assert caught.value.field == "name"


def test_an_adapter_name_may_hold_inner_spaces_and_any_letters() -> None:
    check_adapter_name("my adapter/v2-é")


@pytest.mark.parametrize(
    "name", ["cafe\u0301", "\u212b-adapter", "\u1100\u1161"]
)  # e + accent, Angstrom sign, jamo
def test_an_adapter_name_in_a_decomposed_spelling_is_refused_naming_the_composed_one(name: str) -> None:
    # "café" as e + U+0301 beside "café" with U+00E9: two adapters, listed and named apart, that look alike.
    composed = unicodedata.normalize("NFC", name)
    assert composed != name
    with pytest.raises(InvalidArgument, match="must be in Unicode's composed form \\(NFC\\), as ") as caught:
        check_adapter_name(name, "name")
    assert caught.value.field == "name" and repr(composed) in caught.value.description
    check_adapter_name(composed, "name")


@pytest.mark.parametrize(
    "label, rule",
    [
        ("r1\nINFO forged line", "control characters"),
        ("r1\x1b[2J", "control characters"),
        ("r1\u2028INFO forged line", "line separators"),  # str.splitlines breaks here too
        ("qv4\u200b", "U+200B: zero-width"),  # shows as "qv4"
        ("r1\u202eexe.txt", "U+202E: zero-width spaces"),  # shows reversed after it
        ("\ufeffr1", "invisible characters"),
        ("r1\u2066x", "U+2066"),
        # What the second reviewer found passing the first list: each shows as "qv4".
        ("qv4\u00ad", "U+00AD"),  # a soft hyphen
        ("q\u00adv4", "U+00AD"),
        ("qv4\u200c", "U+200C"),  # a joiner with nothing to join
        ("qv4\u200d", "U+200D"),
        ("q\u2063v4", "U+2063"),  # an invisible separator
        ("qv4\u2064", "U+2064"),
        ("qv4\u206a", "U+206A"),
        ("qv4\u180e", "U+180E"),
        ("qv4\U000e0041", "U+E0041"),  # a tag not after the black flag
        ("qv4\u034f", "U+034F"),
        ("qv4\ufe0f", "U+FE0F"),  # a presentation selector after ASCII
        ("qv4\u3164", "U+3164"),  # a Hangul filler
        ("r1 ", "white space"),
        ("\u3000r1", "white space"),  # an ideographic space
    ],
)
def test_a_label_that_could_forge_a_log_line_or_hide_a_twin_is_refused_naming_its_field(
    label: str, rule: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_label(label, "request_id")
    assert caught.value.field == "request_id" and rule in caught.value.description
    assert "\n" not in caught.value.message and "\u2028" not in caught.value.message  # echoed escaped


def test_a_label_may_be_empty_hold_inner_spaces_and_any_letters() -> None:
    # The zero-width non-joiner of a Persian word, the joiners of an emoji sequence, an emoji's
    # presentation selector, England's flag (tags after the black flag): invisible characters with work
    # to do where they stand, unlike those refused above.
    for label in (
        "",
        "cmpl-7 retry 2",
        "é-ü/日本",
        "می\u200cخواهم",
        "👨\u200d👩\u200d👧",
        "❤\ufe0f",
        "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
    ):
        check_label(label, "request_id")


def test_a_served_name_is_one_a_request_can_name() -> None:
    check_served_name("n" * 256)
    check_served_name("é" * 128)  # 256 bytes of UTF-8
    for name, said in (
        ("n" * 257, "must be at most 256 bytes of UTF-8 (the longest `model` a request may name), got 257"),
        ("n\udcff", "must be valid UTF-8 (unset, it is the model directory's or file's name)"),
    ):
        with pytest.raises(ConfigError) as refused:
            check_served_name(name)
        assert (refused.value.field, refused.value.reason) == ("model_name", said)


def test_the_served_name_is_the_flags_or_else_the_models_own() -> None:
    assert served_model_name("m1", Path("/models/tiny"), "tiny") == "m1"
    assert served_model_name(None, Path("/models/tiny"), "tiny") == "tiny"
    assert served_model_name(None, Path("/models/My Model"), "My Model") == "My Model"


def test_an_empty_model_name_flag_is_refused_rather_than_read_as_the_directorys() -> None:
    with pytest.raises(ConfigError) as refused:
        served_model_name("", Path("/models/tiny"), "tiny")
    assert refused.value.field == "model_name"
    assert refused.value.reason.startswith("must name a model, got ''")


@pytest.mark.parametrize(
    ("model", "display_name", "why"),
    [
        (
            "/models/My Model ",
            "My Model ",
            "the directory's name 'My Model ' cannot be served as a model name (a model name must not "
            "begin or end with white space, got 'My Model ')",
        ),
        (
            "/models/My Model .Q4_0.gguf",
            "My Model ",
            "the file's name 'My Model ' cannot be served as a model name (a model name must not begin "
            "or end with white space, got 'My Model ')",
        ),
        (
            ".",
            "",
            "the directory's name '' cannot be served as a model name (a path ending in '.' or '..', or "
            "the root, has no name of its own)",
        ),
        (
            "/x/..",
            "..",
            "the directory's name '..' cannot be served as a model name (a path ending in '.' or '..', or "
            "the root, has no name of its own)",
        ),
        (
            "/m\udcff",
            "m\udcff",
            "the directory's name 'm\\udcff' cannot be served as a model name (a model name must be "
            "valid UTF-8)",
        ),
    ],
)
def test_a_name_taken_from_the_model_path_that_cannot_be_served_is_refused_naming_the_path(
    model: str, display_name: str, why: str
) -> None:
    """Not --model-name, which the operator never gave: it named that flag for 'My Model ', and
    served '' for `--model .`."""
    with pytest.raises(ConfigError) as refused:
        served_model_name(None, Path(model), display_name)
    assert (refused.value.field, refused.value.reason) == ("model_dir", f": {why}: give --model-name")
