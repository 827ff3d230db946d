"""Records the resizes a picture's preparation makes: what the batcher's weight of a call must count."""

from __future__ import annotations

import pytest
from PIL import Image

Size = tuple[int, int]  # (width, height)


def record_resizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Size, Size]]:
    """(from, to) of every PIL resize made from now on, in order."""
    made: list[tuple[Size, Size]] = []
    resize = Image.Image.resize

    def recorded(image: Image.Image, *args, **kwargs) -> Image.Image:
        out = resize(image, *args, **kwargs)
        made.append((image.size, out.size))
        return out

    monkeypatch.setattr(Image.Image, "resize", recorded)
    return made
