"""Reading a Hugging Face model directory's JSON files, shared by both services.

The decoder's loader and the encoder's embedders read the same config files and must fail the same
way: a message naming the file. Each passes its own error type, so its callers catch one class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A config or generation config is kilobytes, a shard index of tens of thousands of tensors a few MB.
# Parsed, JSON takes more than its size in memory (a 600 MB config.json: 1.5 GB), so a file past this
# is refused from its size.
MAX_JSON_BYTES = 64 << 20


def read_json(path: Path, error: type[Exception]) -> dict[str, Any]:
    """The file's JSON object; raises `error` naming the file when it is missing, larger than
    MAX_JSON_BYTES, unreadable or malformed."""
    try:
        if not path.is_file():
            raise error(f"{path.name} not found in {path.parent}")
        if (size := path.stat().st_size) > MAX_JSON_BYTES:
            raise error(
                f"{path} has {size:,} bytes, more than the {MAX_JSON_BYTES:,} a JSON file of a checkpoint may"
            )
        data = path.read_bytes()
    except OSError as e:  # EACCES, EIO, a file gone since is_file: was a traceback at a service's start
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    return json_object(data, str(path), error)


def json_object(data: bytes, shown: str, error: type[Exception]) -> dict[str, Any]:
    """The JSON object of a file's bytes, read already (a LoRA adapter's config, read from its
    descriptor); raises `error` naming the file `shown` when the bytes are not one."""
    try:
        value = json.loads(data.decode())
    except json.JSONDecodeError as e:
        raise error(f"{shown} is not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise error(f"{shown} is not UTF-8 text: {e}") from None
    except RecursionError:  # json's C parser recurses once per level: 100,000 nested lists reach it
        raise error(f"{shown} nests too deeply to read") from None
    if not isinstance(value, dict):
        raise error(f"{shown} must hold a JSON object, got {type(value).__name__}")
    return value
