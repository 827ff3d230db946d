"""Reading a Hugging Face model directory's JSON files, shared by both services.

The decoder's loader and the encoder's embedders read the same config files and must fail the same
way: a message naming the file. Each passes its own error type, so its callers catch one class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, error: type[Exception]) -> dict[str, Any]:
    """The file's JSON object; raises `error` naming the file when it is missing or malformed."""
    if not path.is_file():
        raise error(f"{path.name} not found in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON: {e}") from e
