"""`tandem make-model` and `tandem import-gguf`: a DIR, an argument or a value they cannot use is one
line naming it, exit 2, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import cli


@pytest.mark.parametrize("tool", [["make-model"], ["import-gguf", "model.gguf"]])
def test_a_dir_that_is_a_file_is_named_before_anything_is_written(
    tool: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mkdir failed with a FileExistsError traceback (import-gguf: after reading the whole file)."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    taken = tmp_path / "taken"
    taken.write_text("")
    argv = [*tool[:1], *(str(tmp_path / a) for a in tool[1:]), str(taken)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"tandem {tool[0]}: DIR {taken}: a file, not a directory\n"


@pytest.mark.parametrize("tool", [["make-model"], ["import-gguf", "model.gguf"]])
def test_a_missing_argument_is_named(tool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """It said "tandem make-model: dir: " and nothing more."""
    assert cli.main(tool) == 2
    assert capsys.readouterr().err == f"tandem {tool[0]}: Missing argument 'DIR'.\n"


def test_a_seed_torch_cannot_take_is_the_seed_s_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's overflow was reported as an error of --shape."""
    assert cli.main(["make-model", str(tmp_path / "m"), "--seed", str(2**64)]) == 2
    assert capsys.readouterr().err.startswith("tandem make-model: --seed (TANDEM_MAKE_MODEL_SEED): ")
    assert not (tmp_path / "m").exists()
