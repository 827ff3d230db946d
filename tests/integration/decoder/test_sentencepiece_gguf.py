"""A Llama GGUF file with a SentencePiece tokenizer (Llama 2's and Mistral's kind) served by
`python -m tandem.decoder --model FILE.gguf`: the chat template's text tokenizes as one text, the
file's EOS ends a turn, and the tokens and text streamed are transformers' greedy ones on that file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from common.tests.common.gguf_files import sentencepiece_fields, small_model, write_gguf
from common.tests.ports import free_port
from tandem.client.client import DecoderClient
from tests.integration.decoder.serving import decoder_process, until_serving

# Llama 2's template, shortened: BOS as a literal, [INST] as plain text, EOS after each answer.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "the world"},
    {"role": "user", "content": "日本 and\nthe rest"},
]
RENDERED = "<s>[INST] hello there [/INST] the world</s>[INST] 日本 and\nthe rest [/INST]"
NUM_NEW_TOKENS = 8


async def _chat(client: DecoderClient) -> tuple[list[int], str, object]:
    ids, text, finished = [], [], None
    async for response in client.chat(
        MESSAGES, max_new_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True
    ):
        if response.HasField("delta"):
            ids += response.delta.token_ids
            text.append(response.delta.text)
        elif response.HasField("finished"):
            finished = response.finished
    return ids, "".join(text), finished


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fields = sentencepiece_fields()
    model = small_model("llama", len(fields.tokens))
    with torch.no_grad():  # a random model's bytes rarely make UTF-8: its text then depends on the window
        model.lm_head.weight[3:259] = 0  # the byte pieces' logits 0, below the best piece's
    return write_gguf(
        tmp_path_factory.mktemp("spm") / "tiny-llama2.gguf", model, fields, chat_template=TEMPLATE
    )


async def test_a_sentencepiece_gguf_file_serves_chats_as_transformers_reads_it(
    gguf_file: Path, tmp_path: Path
) -> None:
    port = free_port()
    args = ["--model", str(gguf_file), "--port", str(port), "--dtype", "float32"]
    with decoder_process(args, env={"HOME": str(tmp_path / "home")}) as run:  # HOME: the import's cache
        async with DecoderClient(f"127.0.0.1:{port}") as client:
            await until_serving(client)
            info = await client.model_info()
            ids, text, finished = await _chat(client)
            tokenized = await client.tokenize(["hello world"])
    assert f"serving tiny-llama2 on port {port}" in run.output, run.output

    (imported,) = (tmp_path / "home").rglob("tokenizer.json")
    tokenizer = Tokenizer.from_file(str(imported))
    assert list(info.eos_token_ids) == [2]  # </s>
    assert tokenizer.decode(tokenized[0], skip_special_tokens=False) == "hello world"
    prompt = tokenizer.encode(RENDERED, add_special_tokens=False).ids
    assert prompt[0] == 1 and prompt.count(1) == 1  # the template's BOS literal, and no second one
    assert finished.usage.input_tokens == len(prompt)
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    expected = reference.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS
    )[0, len(prompt) :].tolist()
    assert ids == expected
    # The text streamed is what the whole sequence gains over the prompt, spaces ("▁") and bytes decoded.
    whole, before = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert whole.startswith(before) and text == whole[len(before) :]
