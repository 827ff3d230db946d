"""Speculation around a step (`step/speculation.py`): what each decoding request proposes before it,
and what it keeps of its samples after it, with the counts the engine reports."""

from __future__ import annotations

from types import SimpleNamespace

from tandem.decoder.engine.sampling.grammar_growth import MatcherFull
from tandem.decoder.engine.sampling.prompt_lookup import PromptLookup
from tandem.decoder.engine.step.speculation import propose, verify

PROMPT = [1, 2, 3, 4, 1, 2]  # its last two tokens occurred before: the lookup proposes [3, 4, 1, 2]


class _Output:
    def __init__(self, max_model_len: int = 100) -> None:
        self.max_model_len = max_model_len
        self.verified: list[tuple[int, int]] = []

    def on_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.verified.append((num_proposed, num_accepted))


class _Rebuilds:
    def __init__(self, pending: set[str] | None = None) -> None:
        self._pending = pending or set()
        self.started: list[str] = []

    def pending(self) -> set[str]:
        return self._pending

    def start(self, request_id: str, constraint: object) -> None:
        self.started.append(request_id)


def _request(request_id: str, max_new_tokens: int = 50, constraint: object = None, is_prefill: bool = False):
    num_tokens = len(PROMPT)
    return SimpleNamespace(
        request_id=request_id,
        num_prompt_tokens=len(PROMPT),
        num_tokens=num_tokens,
        num_computed_tokens=num_tokens - (len(PROMPT) if is_prefill else 1),
        output_token_ids=[],
        num_output_tokens=0,
        stopping=SimpleNamespace(max_new_tokens=max_new_tokens),
        constraint=constraint,
        draft_token_ids=["untouched"],
        num_speculative_tokens=4,
    )


def _tracked(request: SimpleNamespace, num_to_propose: int = 4) -> SimpleNamespace:
    lookup = PromptLookup(PROMPT, [True] * len(PROMPT))
    return SimpleNamespace(
        request=request,
        output=_Output(),
        lookup=lookup,
        num_to_propose=num_to_propose,
        grammar_row_seconds=(0.0, 0.0),
    )


def _propose(
    requests: list[SimpleNamespace], rebuilds: _Rebuilds | None = None, max_batch: int | None = None
):
    live = {request.request_id: _tracked(request) for request in requests}
    propose(
        requests,  # type: ignore[arg-type]
        live,  # type: ignore[arg-type]
        rebuilds or _Rebuilds(),  # type: ignore[arg-type]
        speculative_max_batch=max_batch,
        max_grammar_seconds_per_step=float("inf"),
    )
    return [request.draft_token_ids for request in requests]


def test_a_decoding_request_proposes_what_followed_its_last_tokens_within_its_room() -> None:
    assert _propose([_request("a")]) == [[3, 4, 1, 2]]
    # 3 tokens left: a proposal of 2 and the token after it
    assert _propose([_request("a", max_new_tokens=3)]) == [[3, 4]]


def test_a_prefill_or_a_rebuilding_request_proposes_nothing() -> None:
    drafts = _propose([_request("chunk", is_prefill=True), _request("rebuilt")], _Rebuilds({"rebuilt"}))
    assert drafts == [["untouched"], ["untouched"]]


def test_a_batch_over_speculative_max_batch_proposes_nothing() -> None:
    assert _propose([_request("a"), _request("b")], max_batch=1) == [["untouched"], ["untouched"]]
    assert _propose([_request("a"), _request("b")], max_batch=2) == [[3, 4, 1, 2], [3, 4, 1, 2]]


def test_a_constrained_proposal_is_cut_to_what_its_grammar_accepts_and_a_full_matcher_sits_out() -> None:
    class Grammar:
        mask_seconds = 0.0

        def __init__(self, fills: bool) -> None:
            self.fills = fills

        def valid_prefix(self, draft: list[int]) -> int:
            if self.fills:
                raise MatcherFull
            return 1

    rebuilds = _Rebuilds()
    drafts = _propose(
        [_request("ok", constraint=Grammar(False)), _request("full", constraint=Grammar(True))], rebuilds
    )
    assert drafts == [[3], []]
    assert rebuilds.started == ["full"]


def _item(request_id: str, proposal: list[int]) -> SimpleNamespace:
    request = SimpleNamespace(draft_token_ids=proposal, num_speculative_tokens=4)
    return SimpleNamespace(request_id=request_id, request=request, num_draft_tokens=len(proposal))


def test_verify_keeps_samples_up_to_the_first_that_differs_and_sizes_the_next_proposal() -> None:
    items = [_item("plain", []), _item("missed", [5, 6, 7]), _item("hit", [8, 9])]
    live = {item.request_id: _tracked(item.request, num_to_propose=0) for item in items}
    samples = [42, 5, 6, 1, 2, 8, 9, 3]  # plain: 1 row, missed: 4, hit: 3
    verified = verify(items, samples, live)  # type: ignore[arg-type]
    assert verified.kept == [[42], [5, 6, 1], [8, 9, 3]]
    assert (verified.num_proposed, verified.num_accepted) == (5, 4)
    assert live["missed"].num_to_propose == 3  # one more than it got right
    assert live["hit"].num_to_propose == 4  # all accepted: its maximum
    assert live["plain"].num_to_propose == 0 and live["plain"].output.verified == []
    assert live["missed"].output.verified == [(3, 2)] and live["hit"].output.verified == [(2, 2)]


def test_verify_of_a_request_whose_samples_are_dropped_leaves_no_trace_in_the_counts() -> None:
    items = [_item("full", [5, 6])]
    live = {"full": _tracked(items[0].request, num_to_propose=1)}
    verified = verify(items, [5, 6, 7], live, skip={"full"})  # type: ignore[arg-type]
    assert verified.kept == [[5, 6, 7]]
    assert (verified.num_proposed, verified.num_accepted) == (0, 0)
    assert live["full"].num_to_propose == 1 and live["full"].output.verified == []
