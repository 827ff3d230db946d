"""Structured output through a live decoder (the tiny random model, so only the grammar makes its
answers parse): JSON schemas, json_object, regular expressions, choices and Lark grammars, greedy and
sampled, alone and in a batch with free requests, from token, embedding and chat prompts."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import grpc
import jiter
import jsonschema
import pytest
import torch

from tandem.client.client import structured_output
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.common.torch_part import tensors
from tandem.decoder.models.loader import LoadedModel
from tests.integration.decoder.conftest import Served, serve, shutdown

S = {"type": "string", "maxLength": 8}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def obj(**properties: dict) -> dict:
    """An object with exactly these properties (extra ones would let a random model write keys forever)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


SCHEMAS = [
    obj(name=S),
    obj(age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(ok={"type": "boolean"}),
    obj(color={"enum": ["red", "green", "blue"]}),
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {"type": "array", "items": S, "maxItems": 3},
    obj(tags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}),
    obj(inner=obj(x=DIGIT)),
    obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]},
    obj(v={"anyOf": [S, {"type": "null"}]}),
    obj(a={"type": "integer", "minimum": 1, "maximum": 3}, b=S),
    {"enum": ["yes", "no", 1, None]},
    obj(points={"type": "array", "maxItems": 2, "items": obj(x=DIGIT)}),
    {"type": "string", "maxLength": 12},
    {"type": "integer", "minimum": 10, "maximum": 20},
    obj(kind={"const": "point"}, n={"type": "integer", "minimum": 0, "maximum": 5}),
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, 2]}], "items": False},
    obj(email={"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}),
    obj(level={"enum": [0.5, 1.5, 2.5]}, on={"type": "boolean"}),
]
PROMPT = "Answer in JSON:"
SELF_REFERENCE = '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'


async def _answer(decoder: Served, structured, **kwargs) -> tuple[str, decoder_pb2.Finished]:
    kwargs.setdefault("max_new_tokens", 160)
    return await decoder.client.generate_text([PROMPT], structured=structured, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_every_answer_to_twenty_schemas_validates(decoder: Served, temperature: float) -> None:
    for i, schema in enumerate(SCHEMAS):
        text, finished = await _answer(
            decoder, structured_output(json_schema=schema), temperature=temperature, seed=i
        )
        assert finished.reason == decoder_pb2.FINISH_REASON_EOS, (i, text)
        jsonschema.validate(json.loads(text), schema)


async def test_a_batch_of_sixteen_mixing_constrained_and_free_requests(decoder: Served) -> None:
    async def free() -> str:
        return (await decoder.client.generate_text([PROMPT], max_new_tokens=24, temperature=0))[0]

    alone = await free()
    schemas = SCHEMAS[:12]
    results = await asyncio.gather(
        *(_answer(decoder, structured_output(json_schema=s), temperature=0.8, seed=7) for s in schemas),
        *(free() for _ in range(4)),
    )
    for schema, (text, finished) in zip(schemas, results[:12], strict=True):
        assert finished.reason == decoder_pb2.FINISH_REASON_EOS
        jsonschema.validate(json.loads(text), schema)
    assert all(text == alone for text in results[12:])  # free neighbours are untouched


async def test_the_same_seed_gives_the_same_answer(decoder: Served) -> None:
    schema = structured_output(json_schema=SCHEMAS[5])
    first = await _answer(decoder, schema, temperature=1.0, seed=11)
    second = await _answer(decoder, schema, temperature=1.0, seed=11)
    assert first[0] == second[0]


async def test_regex_choice_json_object_and_a_lark_grammar(decoder: Served) -> None:
    text, _ = await _answer(decoder, structured_output(regex="[0-9]{3}-[a-z]{2}"), temperature=1.0, seed=3)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text)
    text, _ = await _answer(decoder, structured_output(choice=["positive", "negative", "neutral"]))
    assert text in ("positive", "negative", "neutral")
    ends = set()
    for seed in range(4):  # sampled: some answers close their object, some are cut at max_new_tokens
        text, finished = await _answer(
            decoder, structured_output(json_object=True), max_new_tokens=96, temperature=1.0, seed=seed
        )
        assert _is_json_object_so_far(text, finished), (seed, finished.reason, text)
        ends.add(finished.reason)
    assert ends == {decoder_pb2.FINISH_REASON_EOS, decoder_pb2.FINISH_REASON_LENGTH}  # both were checked
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    text, _ = await _answer(decoder, structured_output(grammar=grammar), temperature=1.0, seed=5)
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text), text


def _is_json_object_so_far(text: str, finished: decoder_pb2.Finished) -> bool:
    """A whole JSON object if the answer ended at EOS; cut at the token limit, an object or the start of
    one: what is complete parses with nothing after it, what is not jiter's partial mode (an independent
    parser) accepts."""
    if finished.reason == decoder_pb2.FINISH_REASON_EOS:
        return isinstance(json.loads(text), dict)
    assert finished.reason == decoder_pb2.FINISH_REASON_LENGTH, finished.reason
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        try:
            return text.startswith("{") and isinstance(
                jiter.from_json(text.encode(), partial_mode=True), dict
            )
        except ValueError:
            return False
    return isinstance(value, dict) and not text[end:].strip()


async def test_embedding_and_chat_prompts_and_speculation_compose(decoder: Served, tiny_fp32) -> None:
    schema = SCHEMAS[11]
    ids = tiny_fp32.tokenizer.encode(PROMPT).ids
    rows = tensors.encode(tiny_fp32.model.embed_tokens.weight[torch.tensor(ids)].detach())
    as_rows, _ = await decoder.client.generate_text(
        [rows], structured=structured_output(json_schema=schema), max_new_tokens=160, temperature=0
    )
    as_ids, _ = await decoder.client.generate_text(
        [ids], structured=structured_output(json_schema=schema), max_new_tokens=160, temperature=0
    )
    assert as_rows == as_ids
    jsonschema.validate(json.loads(as_rows), schema)
    chat, finished = await decoder.client.chat_text(
        [{"role": "user", "content": PROMPT}], structured=structured_output(json_schema=schema), temperature=0
    )
    assert finished.reason == decoder_pb2.FINISH_REASON_EOS
    jsonschema.validate(json.loads(chat), schema)
    speculated, _ = await decoder.client.generate_text(
        [ids], structured=structured_output(json_schema=schema), max_new_tokens=160, temperature=0,
        speculative_tokens=4,
    )  # fmt: skip
    assert speculated == as_ids


async def test_speculation_proposes_only_what_the_grammar_accepts_and_changes_nothing(
    decoder: Served,
) -> None:
    """A prompt full of the answer's shape gives prompt lookup proposals to verify; the grammar cuts each
    at its first refused token and masks every verifying row, so the tokens are plain decoding's."""
    schema = {"type": "array", "items": {"enum": ["ab", "cd", "ef"]}, "minItems": 6, "maxItems": 6}
    prompt = ['["ab","cd","ef","ab","cd","ef"] ["ab","cd","ef","ab","cd","ef"] ["ab","cd"']
    for temperature in (0.0, 1.0):
        plain, _ = await decoder.client.generate_text(
            prompt, structured=structured_output(json_schema=schema), temperature=temperature, seed=2,
            max_new_tokens=64,
        )  # fmt: skip
        fast, finished = await decoder.client.generate_text(
            prompt, structured=structured_output(json_schema=schema), temperature=temperature, seed=2,
            max_new_tokens=64, speculative_tokens=6,
        )  # fmt: skip
        assert fast == plain and json.loads(fast)
        jsonschema.validate(json.loads(fast), schema)
        assert finished.proposed_tokens > 0, finished


async def test_a_cut_answer_says_length(decoder: Served) -> None:
    _, finished = await _answer(decoder, structured_output(json_schema=SCHEMAS[7]), max_new_tokens=2)
    assert finished.reason == decoder_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("structured", "kwargs", "field"),
    [
        (decoder_pb2.StructuredOutput(json_schema="{not json"), {}, "structured.json_schema"),
        (decoder_pb2.StructuredOutput(json_schema="[1, 2]"), {}, "structured.json_schema"),
        (decoder_pb2.StructuredOutput(regex="(("), {}, "structured.regex"),
        (decoder_pb2.StructuredOutput(grammar="start: undefined_rule"), {}, "structured.grammar"),
        # No finite JSON matches it: it used to end `stop` with an empty answer.
        (decoder_pb2.StructuredOutput(json_schema=SELF_REFERENCE), {}, "structured.json_schema: admits no"),
        (decoder_pb2.StructuredOutput(grammar="start: a\na: a"), {}, "structured.grammar: admits no"),
        (decoder_pb2.StructuredOutput(regex="x" * 70_000), {}, "structured.regex"),
        (decoder_pb2.StructuredOutput(choice=decoder_pb2.StructuredChoices()), {}, "structured.choice"),
        (structured_output(choice=["a", ""]), {}, "structured.choice"),
        (decoder_pb2.StructuredOutput(), {}, "structured"),
        (decoder_pb2.StructuredOutput(regex="a"), {"ignore_eos": True}, "stopping.ignore_eos"),
    ],
)  # fmt: skip
async def test_a_bad_grammar_is_invalid_argument_naming_the_field(
    decoder: Served, structured, kwargs, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _answer(decoder, structured, **kwargs)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field), error.value.details()
    text, _ = await _answer(decoder, structured_output(regex="ok"))  # and it keeps serving
    assert text == "ok"


async def test_a_grammar_past_the_lexer_fuel_is_refused_before_it_runs_its_neighbour_unchanged(
    decoder: Served,
) -> None:
    # With llguidance's default fuel it compiled and began in 1.3-2.5 s, then failed a token in
    # (after which its matcher allowed only EOS, which had ended `stop` with an answer the regex does
    # not match); now its first token, taken when it is built, tells the exhausted fuel.
    blocks = decoder.engine.core.block_manager
    initial = blocks.num_free_blocks
    free = decoder.client.generate_text(["Once upon a time"], max_new_tokens=12, temperature=0.0)
    alone, _ = await decoder.client.generate_text(["Once upon a time"], max_new_tokens=12, temperature=0.0)
    broken = _answer(decoder, structured_output(regex="a{1000}{1000}"), max_new_tokens=30)
    results = await asyncio.gather(free, broken, return_exceptions=True)
    assert isinstance(results[1], grpc.aio.AioRpcError), results[1]
    assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert results[1].details().startswith("structured.regex: is too complex"), results[1].details()
    assert "lexer fuel" in results[1].details()
    assert not isinstance(results[0], BaseException) and results[0][0] == alone  # its neighbour: unchanged
    text, _ = await _answer(decoder, structured_output(regex="a{5}{3}"))  # and it keeps serving
    assert text == "a" * 15
    assert decoder.engine.core.num_live() == 0 and blocks.num_free_blocks == initial  # nothing held


async def test_a_grammar_over_the_cpu_limit_per_token_is_an_error_while_its_neighbour_streams(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    # An ambiguous grammar's parse costs more with every token (sampling/structured.py: with SmolLM2's
    # vocabulary up to 0.5 s of CPU a mask), and every step of the batch waits for its masks. The
    # served limit (50 ms) takes hundreds of tokens to reach with the tiny model's vocabulary, so
    # this decoder's (--max-grammar-cpu-ms-per-token 0.001) is below any work: the first mask, or the
    # proposal checked, fails the request.
    decoder = await serve(tiny_model_dir, tiny_fp32, max_grammar_cpu_ms_per_token=0.001)
    try:
        await _fail_the_grammar_over_the_limit(decoder)
    finally:
        await shutdown(decoder)


async def _fail_the_grammar_over_the_limit(decoder: Served) -> None:
    blocks = decoder.engine.core.block_manager
    initial = blocks.num_free_blocks
    alone, _ = await decoder.client.generate_text(["Once upon a time"], max_new_tokens=12, temperature=0.0)
    for speculative_tokens in (0, 4):
        free = decoder.client.generate_text(["Once upon a time"], max_new_tokens=12, temperature=0.0)
        slow = decoder.client.generate_text(
            ["a a a a a a a a"], structured=structured_output(grammar='start: s\ns: s s s | s s | "a"'),
            max_new_tokens=64, speculative_tokens=speculative_tokens,
        )  # fmt: skip
        results = await asyncio.gather(free, slow, return_exceptions=True)
        assert isinstance(results[1], grpc.aio.AioRpcError), results[1]
        assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT
        details = results[1].details()
        assert details.startswith("structured.grammar: the grammar's work took"), details
        assert "over the limit of 0.001 ms" in details, details
        assert (
            not isinstance(results[0], BaseException) and results[0][0] == alone
        )  # its neighbour: unchanged
    again, _ = await decoder.client.generate_text(["Once upon a time"], max_new_tokens=12, temperature=0.0)
    assert again == alone  # and it keeps serving
    assert decoder.engine.core.num_live() == 0 and blocks.num_free_blocks == initial  # nothing held


async def test_a_grammar_naming_the_eos_token_as_text_is_an_error_never_an_eos_answer(
    decoder: Served,
) -> None:
    # `<[eos]>` is the only token the grammar allows first; sampled, the model's EOS ended the request
    # with FINISH_REASON_EOS and an empty answer, which the grammar (it wants "a" after) does not match.
    (eos,) = decoder.engine.model_config.eos_token_ids
    blocks = decoder.engine.core.block_manager
    initial = blocks.num_free_blocks
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _answer(decoder, structured_output(grammar=f'start: <[{eos}]> "a"'), temperature=0.0)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(
        f"structured.grammar: the grammar takes the model's end-of-sequence token {eos} as text"
    ), error.value.details()
    text, finished = await _answer(decoder, structured_output(regex="ok"))  # the EOS that ends one still does
    assert (text, finished.reason) == ("ok", decoder_pb2.FINISH_REASON_EOS)
    assert decoder.engine.core.num_live() == 0 and blocks.num_free_blocks == initial  # nothing held


async def test_batch_invariant_serving_keeps_the_grammar(tiny_model_dir, tiny_fp32) -> None:
    from tests.integration.decoder.conftest import serve, shutdown

    served = await serve(tiny_model_dir, tiny_fp32, batch_invariant=True)
    try:
        schema = SCHEMAS[11]
        results = await asyncio.gather(
            *(
                _answer(served, structured_output(json_schema=schema), temperature=1.0, seed=s)
                for s in range(4)
            )
        )
        for text, finished in results:
            assert finished.reason == decoder_pb2.FINISH_REASON_EOS
            jsonschema.validate(json.loads(text), schema)
    finally:
        await shutdown(served)


async def test_stop_strings_end_a_constrained_answer_early(decoder: Served) -> None:
    text, finished = await _answer(decoder, structured_output(regex="(ab,){20}"), stop_sequences=[",ab,"])
    assert finished.reason == decoder_pb2.FINISH_REASON_STOP_SEQUENCE and text == "ab"  # before the stop


async def test_tandem_generate_takes_a_json_schema_file_and_a_choice(decoder: Served, tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[3]))
    repo = Path(__file__).resolve().parents[3]

    async def run(*args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.cli", "generate", "--address", decoder.server.address,
            "--prompt", PROMPT, "--max-tokens", "64", "--temperature", "0", *args,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 120)
        return process.returncode or 0, out.decode(), err.decode()

    code, out, err = await run("--json-schema", str(schema_file))
    assert code == 0, err
    jsonschema.validate(json.loads(out.split("\n[")[0]), SCHEMAS[3])
    code, out, _ = await run("--choice", "left", "--choice", "right")
    assert out.split("\n[")[0] in ("left", "right")
    code, _, err = await run("--regex", "a", "--choice", "b")
    assert code == 2 and "at most one of" in err


async def test_a_hostile_grammar_costs_its_caller_an_error_while_health_answers(decoder: Served) -> None:
    """Sources built to explode a compiler: llguidance's parser limits refuse them, in the request
    builder's thread, while the server's health keeps answering within a second."""
    hostile = [
        structured_output(regex="(" * 2000 + "a" + ")*" * 2000),
        structured_output(regex="(a|aa|aaa|aaaa)*(b|bb|bbb){1000}[a-z]{1000}"),
        structured_output(json_schema={"anyOf": [{"type": "string", "pattern": f"^a{{{i}}}b+$"} for i in range(400)]}),  # noqa: E501
        structured_output(grammar="start: " + " | ".join(f'"t{i}" start' for i in range(5000))),
        # 3,500 rules each naming the next (58 KB): llguidance's recursion overflowed an 8 MiB stack
        structured_output(grammar="start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(3500)) + '\nr3500: "a"'),  # noqa: E501
    ]  # fmt: skip
    worst = 0.0
    for structured in hostile:
        task = asyncio.ensure_future(_answer(decoder, structured, max_new_tokens=4))
        while not task.done():
            start = time.monotonic()
            await decoder.client.health(timeout=1.0)
            worst = max(worst, time.monotonic() - start)
            await asyncio.sleep(0.05)
        try:
            await task  # refused (INVALID_ARGUMENT) or, within the limits, answered
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert error.details().startswith("structured."), error.details()
    assert worst < 1.0


async def test_a_grammar_requests_time_to_first_token_counts_its_wait_to_be_built(decoder: Served) -> None:
    # Grammars build one at a time: stamped when built, a client's 1.56 s first token read 0.02 s.
    builder = decoder.engine._builders.structured
    in_front = threading.Event()
    builder.submit("another caller", in_front.wait, 10)  # another caller's grammar, in front
    answer = asyncio.ensure_future(_answer(decoder, structured_output(regex="a+"), max_new_tokens=2))
    # Released 0.3 s after the request has queued behind it (a sleep of 0.3 s begun before the call
    # arrived read 0.295 s under load): the request's arrival was stamped before it queued.
    while builder.num_waiting() == 0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.3)
    in_front.set()
    _, finished = await answer
    assert finished.time_to_first_token_s >= 0.3 and finished.queue_time_s >= 0.3
