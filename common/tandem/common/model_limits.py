"""Sane ranges for the hyper-parameters a checkpoint states, shared by config.json and GGUF readers.

A checkpoint is untrusted input: its numbers size everything that follows (layers built, buffers,
the context GetModelInfo reports as a uint32), so each is checked against these before anything is
built from it. num_hidden_layers 10^12 hung the decoder building modules; max_position_embeddings
2^50 could not be reported; GGUF's block_count 10^9 grew a server past 6 GB. Each bound is far above
any real model: Llama 3 405B has 126 layers, 128 heads, 16,384 hidden, 53,248 intermediate, a 128K
context and a vocabulary of 128K tokens.
"""

from __future__ import annotations

MAX_LAYERS = 1024
MAX_HEADS = 1024  # query heads and key/value heads alike
MAX_HIDDEN_SIZE = 1 << 17
MAX_INTERMEDIATE_SIZE = 1 << 20
MAX_HEAD_DIM = 4096
MAX_POSITIONS = 1 << 24  # the context; GetModelInfo's max_context_tokens is a uint32
MAX_VOCAB = 1 << 22  # token IDs travel as uint32; 4M entries is 30x the largest vocabulary in use
MAX_RMS_NORM_EPS = 1.0  # an epsilon is far below 1
MAX_ROPE_THETA = 1e12  # RoPE bases run from 10^4 to 10^8 in use
