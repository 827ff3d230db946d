"""Flag values the command-line tools share."""

from __future__ import annotations

import pytest

from tandem.common.flags import SIZES


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["generate", "--prompt", "\udcff"], "--prompt (TANDEM_GENERATE_PROMPT)"),
        (["generate", "--prompt", "hi", "--stop", "\udcff"], "--stop (TANDEM_GENERATE_STOP)"),
        (["generate", "--part", "text:\udcff"], "--part (TANDEM_GENERATE_PART)"),
        (["generate", "--address", "\udcff", "--prompt", "hi"], "--address (TANDEM_GENERATE_ADDRESS)"),
        (["embed", "--text", "\udcff"], "--text (TANDEM_EMBED_TEXT)"),
        (["serve", "decoder", "--host", "\udcff"], "--host (TANDEM_HOST)"),
    ],
)
def test_a_text_flag_that_is_not_utf8_is_refused_naming_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes that are not UTF-8 (a shell's $'\\xff', held as surrogate escapes) failed when sent, with a
    UnicodeEncodeError traceback."""
    from tandem import cli

    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(
        f"tandem {' '.join(argv[: 2 if argv[0] == 'serve' else 1])}: {flag}: "
    )


@pytest.mark.parametrize("flag", ["--seq-buckets", "--token-buckets", "--block-table-buckets"])
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_list_of_sizes_is_refused_naming_the_flag_not_read_as_the_default(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--seq-buckets ""` served the default buckets, silently."""
    from tandem import cli

    # --port -1: read as the default, the empty list got past parsing to the port's refusal, not to a server.
    assert cli.main(["serve", "decoder", flag, value, "--port", "-1"]) == 2
    variable = "TANDEM_" + flag.removeprefix("--").replace("-", "_").upper()
    assert capsys.readouterr().err == (
        f"tandem serve decoder: {flag} ({variable}): {value!r} is an empty list: give at least one size "
        "(e.g. 16,64,128), or leave the flag out for its default\n"
    )


def test_an_empty_list_of_sizes_from_a_variable_is_quoted_as_set_and_says_to_unset_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TANDEM_SEQ_BUCKETS="  " was said as '' and told to leave out a flag nobody typed."""
    from tandem import cli

    monkeypatch.setenv("TANDEM_SEQ_BUCKETS", "  ")
    assert cli.main(["serve", "decoder", "--port", "-1"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --seq-buckets (TANDEM_SEQ_BUCKETS): '  ' is an empty list: give at least "
        "one size (e.g. 16,64,128), or unset the variable for its default\n"
    )


def test_sizes_are_comma_separated_integers() -> None:
    assert SIZES.convert(" 1,8, 32 ", None, None) == (1, 8, 32)


@pytest.mark.parametrize("timeout", ["1e309", "-1e309", "1e400"])
def test_a_number_past_a_float_s_range_is_not_read_as_no_limit(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """float() reads "1e309" as inf: `tandem wait --timeout-s 1e309` waited for ever."""
    from tandem import cli

    assert cli.main(["wait", "--timeout-s", timeout, "127.0.0.1:1"]) == 2
    assert f"or inf for no limit, got {timeout!r}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--auth-token-file", "--tls-ca", "--tls-cert"])
def test_an_empty_path_flag_is_named_empty_not_dot(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """click turns '' into Path("."): it was said as ".: Is a directory"."""
    from tandem import cli

    assert cli.main(["wait", flag, "", "127.0.0.1:1"]) == 2
    variable = "TANDEM_WAIT_" + flag.removeprefix("--").replace("-", "_").upper()
    assert capsys.readouterr().err == (
        f"tandem wait: {flag} ({variable}): '' is empty: name a path, or leave the flag out\n"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "decoder", "--model", ""], "tandem serve decoder: --model (TANDEM_MODEL)"),
        (
            ["serve", "encoder", "--encoder-model", " "],
            "tandem serve encoder: --encoder-model (TANDEM_ENCODER_ENCODER_MODEL)",
        ),
        (["serve", "encoder", "--adapter", ""], "tandem serve encoder: --adapter (TANDEM_ENCODER_ADAPTER)"),
    ],
)
def test_an_empty_directory_flag_asks_for_a_path_not_a_file(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """PATH serves flags taking a directory (--model, --adapter, --encoder-model) too."""
    from tandem import cli

    assert cli.main([*argv, "--port", "0"]) == 2
    empty = repr(argv[-1])
    assert capsys.readouterr().err == f"{said}: {empty} is empty: name a path, or leave the flag out\n"
