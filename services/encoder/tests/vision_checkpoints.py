"""Tiny random vision-language checkpoints written by transformers: LLaVA (CLIP or SigLIP tower) and
SmolVLM (Idefics3). Each directory is what `save_pretrained` writes for the model and its processor:
config.json, model.safetensors, tokenizer files, preprocessor_config.json and the chat template.

Their weights are noise, at scales large enough that greedy decoding varies (see random_model.py),
so "the same 16 greedy tokens as transformers" is a real comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from tandem.common.torch_part.random_model import EOS_TOKEN, train_tokenizer

IMAGE_TOKEN = "<image>"
# llava-1.5-hf's template: images first, then text (`generation` marks text for training masks).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' ' }}{% endgeneration %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def tokenizer_with(extra_special: list[str]):  # -> (PreTrainedTokenizerFast, vocab size rounded up to 64)
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens(extra_special)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return fast, -(-size // 64) * 64


def make_llava(
    out_dir: Path,
    tower: str = "clip",
    seed: int = 0,
    strategy: str | None = None,
    feature_layer: int | list[int] = -2,
    projector_bias: bool = True,
    vision_sizes: dict[str, int] | None = None,
    text_sizes: dict[str, int] | None = None,
    text_model: str = "llama",
) -> Path:
    """A LlavaForConditionalGeneration with a `tower` ("clip" or "siglip"), by default of 36 x 36 pixels in
    6 x 6 patches over a 64-wide language model (`vision_sizes` / `text_sizes` override: the benchmark's
    SigLIP-B/16) of the family `text_model` names ("llama", "qwen2" as llava-interleave-qwen's, "mistral").
    `strategy` (vision_feature_select_strategy) defaults to llava-1.5's "default" for CLIP, "full" for
    SigLIP (which has no class row to drop)."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        MistralConfig,
        Qwen2Config,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    tokenizer, vocab_size = tokenizer_with([IMAGE_TOKEN])
    vision_sizes = vision_sizes or dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=36,
        patch_size=6,
    )
    side, patch = vision_sizes["image_size"], vision_sizes["patch_size"]
    if tower == "clip":
        vision = CLIPVisionConfig(**vision_sizes, initializer_factor=5.0)
        processor = CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
    else:
        vision = SiglipVisionConfig(**vision_sizes)
        processor = SiglipImageProcessorPil(size={"height": side, "width": side})
    text_sizes = text_sizes or dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    text_config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[text_model]
    text = text_config_class(
        **text_sizes,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy=strategy or ("default" if tower == "clip" else "full"),
        vision_feature_layer=feature_layer,
        multimodal_projector_bias=projector_bias,
        image_seq_length=(side // patch) ** 2,
    )
    model = LlavaForConditionalGeneration(config).train(False)
    with torch.no_grad():  # transformers starts biases at zero: a reader that dropped Qwen2's would pass
        for name, bias in model.named_parameters():
            if "language_model" in name and name.endswith("_proj.bias"):
                bias.normal_(0.0, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    LlavaProcessor(
        image_processor=processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1 if tower == "clip" else 0,  # the class row
        chat_template=LLAVA_TEMPLATE,
    ).save_pretrained(out_dir)
    return out_dir


def make_image(path: Path, size: tuple[int, int] = (53, 41), seed: int = 0, mode: str = "RGB") -> Path:
    """A noise picture of `size` (width, height), saved in the format its suffix names."""
    generator = torch.Generator().manual_seed(seed)
    channels = len(mode)
    pixels = torch.randint(0, 256, (size[1], size[0], channels), generator=generator, dtype=torch.uint8)
    Image.fromarray(pixels.numpy().squeeze(-1) if channels == 1 else pixels.numpy(), mode).save(path)
    return path


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
