"""The sample of this decoder's token table that GetModelInfo reports: a gateway in front of several
decoder replicas compares theirs, since two checkpoints of one shape under one `--model-name` report
the same name, hidden size and vocabulary (`tandem.common.token_table_sample`).

Read as the encoder check reads it (`tandem.common.torch_part.model_identity`), from the checkpoint
directory the engine loads, so it is the table the engine looks rows up in:
- A GGUF file: the directory it was imported into, its tables dequantized (`gguf_import`), also under
  --quantization gguf, which looks rows up in the file's quantized blocks, dequantized to the same
  values. Replicas of one file agree whatever dtype each imported it in (within the tolerance); one
  file quantized from a checkpoint does not agree with that checkpoint's replicas, whose rows differ
  by the quantization's error: its answers are another model's.
- --quantization int8 / int4 round at load, never in the files: the sample is the checkpoint's.
- LoRA adapters never adapt the token table (`tandem.decoder.models.peft_config`): the sample is the
  base model's, whatever adapters are loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common.token_table_sample import sample_to_pb
from tandem.common.torch_part.model_identity import read_table_sample

log = logging.getLogger("tandem.decoder")


def checkpoint_sample(model_dir: Path) -> encoder_pb2.TokenTableSample | None:
    """The sample of `model_dir`'s token table; None (GetModelInfo leaves it unset, and a gateway
    compares this replica by its name alone) where the checkpoint has no table under the name its
    layout gives, said once at start."""
    try:
        return sample_to_pb(read_table_sample(model_dir, ValueError))
    except ValueError as error:
        log.warning("no token table sample for GetModelInfo (replicas compared by name only): %s", error)
        return None
