"""Network input is never unpickled or torch.load-ed: the serving code does not even import them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = re.compile(r"\b(import pickle|from pickle|cPickle|dill|torch\.load\(|marshal\.loads|shelve)\b")


def test_serving_code_has_no_pickle_or_torch_load() -> None:
    offenders = []
    for package in ("common", "services"):
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if FORBIDDEN.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_scan_would_catch_one() -> None:
    assert FORBIDDEN.search("state = torch.load(buffer)")
    assert FORBIDDEN.search("import pickle")
