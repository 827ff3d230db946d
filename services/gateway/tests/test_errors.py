"""The services' field paths, in the body's own terms: a structured-output error names the field the
caller used to ask for it."""

from __future__ import annotations

import pytest

from tandem.gateway.errors import body_field


@pytest.mark.parametrize(
    ("path", "structured_field", "expected"),
    [
        ("structured.regex", "guided_regex", "guided_regex"),
        ("structured.grammar: does not compile: x", "guided_grammar", "guided_grammar: does not compile: x"),
        ("structured.json_schema", "guided_json", "guided_json"),
        ("structured.choice", "guided_choice", "guided_choice"),
        ("structured.json_schema", "response_format", "response_format.json_schema.schema"),
        ("structured.json_object", "response_format", "response_format"),
        ("structured", None, "response_format"),
        ("structured output is not available on this server", "guided_regex",
         "structured output is not available on this server"),  # the words, not a field
        ("chat.messages[2].content[0].image", "guided_regex", "messages[2].content[0].image"),
        ("stopping.stop_sequences[0]", None, "stop[0]"),
        ("sampling.top_k", None, "top_k"),
    ],
)  # fmt: skip
def test_a_service_path_is_named_as_the_body_names_it(
    path: str, structured_field: str | None, expected: str
) -> None:
    assert body_field(path, structured_field) == expected
