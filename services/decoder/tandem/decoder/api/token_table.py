"""The samples of this decoder's checkpoint that GetModelInfo reports: a gateway in front of several
decoder replicas compares theirs, since two checkpoints of one shape under one `--model-name` report
the same name, hidden size and vocabulary. The token table's (`tandem.common.token_table_sample`),
and a few later weights' (`tandem.common.weight_sample`: the last layer's down_proj, the final norm,
an untied lm_head), since a fine-tune that froze the table, or a merged LoRA, keeps the base's table.
What they do not tell apart: a tune that moves every sampled value by less than 2^-7 relative, and
one that changes only layers not sampled (their weights are never compared).

Read as the encoder check reads it (`tandem.common.torch_part.model_identity`), a few rows of each
tensor (1.4-2.3 ms for the table on SmolLM2), from the checkpoint directory the engine loads, so they
are the weights the engine computes with:
- A GGUF file: the directory it was imported into, its tensors dequantized (`gguf_import`), also under
  --quantization gguf, which looks rows up in the file's quantized blocks, dequantized to the same
  values. Replicas of one file agree whatever dtype each imported it in (within the tolerance); one
  file quantized from a checkpoint does not agree with that checkpoint's replicas, whose rows differ
  by the quantization's error: its answers are another model's.
- --quantization int8 / int4 round at load, never in the files: the samples are the checkpoint's.
- LoRA adapters loaded at run time never adapt the token table (`tandem.decoder.models.peft_config`)
  nor change the checkpoint: the samples are the base model's, whatever adapters are loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.common.token_table_sample import sample_to_pb
from tandem.common.torch_part.model_identity import read_table_sample, read_weight_samples
from tandem.common.weight_sample import weight_sample_to_pb

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


def checkpoint_weight_samples(model_dir: Path) -> list[decoder_pb2.WeightSample]:
    """The samples of `model_dir`'s later weights; none (a gateway compares this replica by its name
    and table alone) where they cannot be read, said once at start."""
    try:
        return [weight_sample_to_pb(sample) for sample in read_weight_samples(model_dir, ValueError)]
    except ValueError as error:
        log.warning("no weight samples for GetModelInfo (replicas compared by name and table): %s", error)
        return []
