"""A tiny random SmolVLM (`Idefics3ForConditionalGeneration`) written by transformers, with its processor.

The directory is what `save_pretrained` writes for the model and an `Idefics3Processor`: config.json,
model.safetensors, the tokenizer with Idefics3's marker tokens, processor_config.json (the image
processor's settings and `image_seq_len`) and SmolVLM's chat template, which writes `<image>` where
an image goes.

Sizes keep every step small but real: tiles of `image_size` pixels (`max_image_size`), images first
resized so their longest edge is twice that, so a ~100 x 70 picture splits into a 2 x 2 grid plus the
global image. With `splitting` false every image is one tile. A tower of `image_size // patch_size`
patches a side whose position buckets are not `arange` (38: see Idefics3VisionEmbeddings) exercises
the position table the encoder rebuilds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.encoder.tests.vision_checkpoints import IMAGE_TOKEN, tokenizer_with

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# Idefics3Processor looks these up for grids of up to 6 x 6 tiles.
ROW_COL_TOKENS = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
# SmolVLM-Instruct's template: the role, then the message's text and `<image>` items in order.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SCALE_FACTOR = 2


def make_smolvlm(
    out_dir: Path, splitting: bool = True, seed: int = 0, image_size: int = 32, patch_size: int = 8
) -> Path:
    """An Idefics3ForConditionalGeneration with tiles of `image_size` pixels a side, `patch_size` a patch."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    torch.manual_seed(seed)
    tokenizer, vocab_size = tokenizer_with(
        [FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN, END_OF_UTTERANCE, *ROW_COL_TOKENS]
    )
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        initializer_range=0.2,
    )
    text = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
    )
    model = Idefics3ForConditionalGeneration(config).train(False)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=splitting,
        size={"longest_edge": 2 * image_size},
        max_image_size={"longest_edge": image_size},
    )
    Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(image_size // patch_size) ** 2 // SCALE_FACTOR**2,
        chat_template=SMOLVLM_TEMPLATE,
    ).save_pretrained(out_dir)
    return out_dir
