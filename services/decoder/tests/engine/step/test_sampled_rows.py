"""A step's sampled rows (`step/sampled_rows.py`): a seeded row's noise and a row's penalty history
depend on its output position alone, never on the step that samples it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.decoder.engine.step.sampled_rows import Row, generator, history, position_seed, reseed

CPU = torch.device("cpu")


def _tracked(seed: int | None, outputs: list[int], draft: list[int] | None = None) -> SimpleNamespace:
    request = SimpleNamespace(
        sampling=SimpleNamespace(seed=seed),
        num_output_tokens=len(outputs),
        output_token_ids=outputs,
        draft_token_ids=draft or [],
    )
    return SimpleNamespace(request=request, generators=[torch.Generator(CPU)] if seed is not None else [])


def _noise(row: Row) -> torch.Tensor:
    return torch.rand(4, generator=generator(row))


def test_position_seed_is_a_hash_of_seed_and_position() -> None:
    assert position_seed(7, 3) == position_seed(7, 3)
    neighbours = {position_seed(7, 3), position_seed(7, 4), position_seed(8, 3), position_seed(3, 7)}
    assert len(neighbours) == 4
    assert position_seed(-1, 0) == position_seed(2**64 - 1, 0)  # any int seed, taken mod 2**64
    assert 0 <= position_seed(2**70, 2**40) < 2**64


def test_a_seeded_rows_noise_is_its_output_positions_whatever_the_step() -> None:
    # Position 4 sampled as a proposal's row (3 outputs, 1 ahead) and as a plain row (4 outputs).
    verifying = _tracked(seed=11, outputs=[1, 2, 3], draft=[9])
    plain = _tracked(seed=11, outputs=[1, 2, 3, 9])
    rows = [Row(verifying, 0), Row(verifying, 1)]  # type: ignore[arg-type]
    reseed(rows, CPU)
    reseed([Row(plain, 0)], CPU)  # type: ignore[arg-type]
    assert len(verifying.generators) == 2  # one added for the row ahead
    assert torch.equal(_noise(rows[1]), _noise(Row(plain, 0)))  # type: ignore[arg-type]
    assert not torch.equal(_noise(Row(verifying, 0)), _noise(Row(plain, 0)))  # type: ignore[arg-type]


def test_an_unseeded_row_has_no_generator_and_reseed_leaves_it_none() -> None:
    unseeded = _tracked(seed=None, outputs=[1], draft=[2, 3])
    rows = [Row(unseeded, j) for j in range(3)]  # type: ignore[arg-type]
    reseed(rows, CPU)
    assert unseeded.generators == [] and [generator(row) for row in rows] == [None, None, None]


def test_a_rows_history_is_the_outputs_then_the_proposals_first_j_tokens() -> None:
    tracked = _tracked(seed=None, outputs=[1, 2], draft=[5, 6, 7])
    assert [history(Row(tracked, j)) for j in range(3)] == [[1, 2], [1, 2, 5], [1, 2, 5, 6]]  # type: ignore[arg-type]
    assert tracked.request.output_token_ids == [1, 2]  # a copy: the request's outputs untouched
