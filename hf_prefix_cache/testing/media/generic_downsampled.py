"""Tiny generic families whose tower turns each 32x32 image into a 4x4 grid of placeholders on its own.

* ``chameleon``: Chameleon, a VQ-VAE (three 2x downsamplings, 8 codes) whose codes map to text ids
  100-107, embedded as the image's 16 placeholders.
* ``step3p7``: Step 3.7, a 2-D RoPE ViT on 2x2-pixel patches, two stride-2 convolutions, 16
  placeholders per global view (calls with local crops, `pixel_values_local`, run cold).
"""

from __future__ import annotations

from typing import Any

from hf_prefix_cache.testing.media.generic_ids import IMG
from hf_prefix_cache.testing.tiny_build import _ROUTED_EXPERTS
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER, vlm

#: Chameleon's VQ codes 0-7 as its vocabulary map names them (``IMGIMG`` + the code's digits as letters + ``Z``).
_CHAMELEON_CODES = {f"IMGIMG{''.join(chr(ord('A') + int(d)) for d in str(code))}Z": 100 + code for code in range(8)}


#: Chameleon's VQ-VAE: 4 resolutions, 8 codes.
_CHAMELEON_VQ: dict[str, Any] = {
    "embed_dim": 8,
    "num_embeddings": 8,
    "latent_channels": 8,
    "resolution": 32,
    "base_channels": 32,
    "channel_multiplier": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "attn_resolutions": [],
}


def tiny_chameleon() -> Any:
    """Chameleon: a VQ-VAE (4 resolutions, 8 codes) gives each 32x32 image 16 code ids, its placeholders."""
    return vlm("Chameleon", **_TEXT, vq_config=_CHAMELEON_VQ, vocabulary_map={"<image>": IMG, **_CHAMELEON_CODES})


def tiny_step3p7() -> Any:
    """Step 3.7: a ViT on 2x2-pixel patches, two stride-2 convolutions (16 placeholders per 32x32 image); Step 3.5
    text [sliding, full] with a dense and an expert MLP."""
    text = {
        **_TEXT,
        "model_type": "step3p5",
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "mlp_layer_types": ["dense", "sparse"],
        **_ROUTED_EXPERTS,
        "share_expert_dim": 32,
        "num_sliding_attention_heads": 4,
        "num_nextn_predict_layers": 0,
    }
    vision = {
        **_TOWER,
        "image_size": 32,
        "patch_size": 2,
    }
    return vlm("Step3p7", text_config=text, vision_config=vision, image_token_id=IMG)
