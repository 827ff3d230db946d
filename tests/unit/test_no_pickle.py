"""Network input is never unpickled, torch.load-ed or evaluated: the serving code has no such calls.

`eval(` is refused everywhere, torch's Module.eval() included (the code says `.train(False)`), so the
scan needs no exceptions a real `eval(` could hide behind.
"""

import re

from tests.layout import REPO_ROOT, python_files

FORBIDDEN = re.compile(
    r"\b(import pickle|from pickle|cPickle|dill|torch\.load\(|marshal\.loads|shelve)\b|\b(eval|exec)\("
)


def test_serving_code_has_no_pickle_torch_load_or_eval() -> None:
    offenders = []
    for path in python_files().values():
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
