"""A tiny random-weight LLaVA with a real processor, built offline, for trying images in the front ends.

The processor is real: transformers' `LlavaProcessor` with its PIL image processor (images
resized and cropped to 32x32) and SmolLM2's tokenizer (from `hf_prefix_cache.models`) plus an
``<image>`` token. The model is a 2-layer Llama text model with a 2-layer CLIP vision tower and
random weights: it writes noise, but it exercises the whole multimodal path (placeholders,
image hashes, reuse of a stored image) exactly as a trained model would.
"""

from __future__ import annotations

from typing import Any

import torch

#: A ChatML-style template that places one ``<image>`` per image block.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_tiny_vlm(seed: int = 0) -> tuple[Any, Any]:
    """A random-weight tiny LLaVA (float32, eval mode) and its real `LlavaProcessor`.

    Returns:
        `(model, processor)`; every 32x32 image becomes 16 ``<image>`` placeholders.

    Raises:
        ModelUnavailableError: SmolLM2's tokenizer cannot be loaded (see `hf_prefix_cache.models`).

    >>> model, processor = load_tiny_vlm()                                  # doctest: +SKIP
    """
    import transformers
    from transformers import AutoTokenizer

    from ..models import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_id, int), image_id
    processor = transformers.LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=transformers.LlavaImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )
    text = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
    }
    config = transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=image_id, vision_feature_layer=-1
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlavaForConditionalGeneration(config)
    model.eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, processor
