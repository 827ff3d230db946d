"""The grammar compiler at the served per-token limit, shared by the compiler's and the constraint's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.structured import GrammarCompiler

SERVED_LIMIT_S = EngineConfig.max_grammar_cpu_ms_per_token / 1000  # the flag's default, in seconds


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    return GrammarCompiler(
        tokenizer, tokenizer.get_vocab_size(), eos_token_ids=(eos,), max_token_cpu_seconds=SERVED_LIMIT_S
    )


@pytest.fixture(scope="module")
def eos(compiler: GrammarCompiler) -> int:
    (token_id,) = compiler.constraint(StructuredOutput("grammar", 'start: "a"')).eos_token_ids
    return token_id
