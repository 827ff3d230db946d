"""models/tensor_parallel.py: the token embedding built for the loader (on the meta device)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.decoder.models.tensor_parallel import VocabParallelEmbedding


def test_an_embedding_built_on_the_meta_device_runs_no_random_init(monkeypatch: pytest.MonkeyPatch) -> None:
    # nn.Embedding's normal_ on a meta tensor imports torch._dynamo (seconds of a decoder start).
    calls: list[torch.Tensor] = []
    monkeypatch.setattr(nn.init, "normal_", lambda tensor, *args, **kwargs: calls.append(tensor))
    with torch.device("meta"):
        embedding = VocabParallelEmbedding(16, 4, None)
    assert embedding.weight.is_meta and embedding.weight.shape == (16, 4)
    assert calls == []


def test_an_embedding_built_on_the_host_is_initialized_as_nn_embedding_is() -> None:
    torch.manual_seed(0)
    embedding = VocabParallelEmbedding(16, 4, None)
    torch.manual_seed(0)
    reference = nn.Embedding(16, 4)
    assert torch.equal(embedding.weight, reference.weight)
