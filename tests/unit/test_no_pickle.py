"""Network input is never unpickled, torch.load-ed or evaluated: the serving code has no such calls.

`eval(` is refused everywhere, torch's Module.eval() included (the code says `.train(False)`), so the
scan needs no exceptions a real `eval(` could hide behind.
"""

import re
from pathlib import Path

from tests.layout import REPO_ROOT, SOURCE_ROOTS

FORBIDDEN = re.compile(
    r"\b(import pickle|from pickle|cPickle|dill|torch\.load\(|marshal\.loads|shelve)\b|\b(eval|exec)\("
)


def unit_files() -> list[Path]:
    """Every Python file of the units (common/, services/*/): their code and, beside it, their tests."""
    return sorted(p for root in SOURCE_ROOTS for p in root.rglob("*.py") if ".egg-info" not in str(p))


def test_serving_code_has_no_pickle_torch_load_or_eval() -> None:
    offenders = []
    files = unit_files()
    assert any("tests" in p.relative_to(REPO_ROOT).parts for p in files)  # the units' tests are read too
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_scan_would_catch_one() -> None:
    assert FORBIDDEN.search("state = torch.load(buffer)")
    assert FORBIDDEN.search("import pickle")
    assert FORBIDDEN.search("value = eval(text)")
    assert FORBIDDEN.search("model.eval()")
    assert FORBIDDEN.search("exec(code)")
    assert not FORBIDDEN.search("model.train(False)")
