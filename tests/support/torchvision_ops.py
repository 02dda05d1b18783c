"""A pytest plugin that lets PyPI's torchvision import beside a CPU-only torch, for Gemma 3n's timm tower.

PyPI's torchvision wheel is built against CUDA torch, so beside a CPU torch its C++ library does
not load. Its import then still registers fake (meta) kernels for two of those C++ ops, `nms` and
`qnms`, which fails unless the ops exist. This plugin declares their two schemas, exactly as
torchvision's C++ code declares them, when no torchvision library has; nothing calls them
(MobileNetV5, the only torchvision user here, runs plain torch operations). Loaded with
``-p support.torchvision_ops`` by `tests/media/test_gemma3n_env.py` beside ``.timm-packages``,
the folder `scripts/install` fills with timm and torchvision (``pip install --no-deps --target``).
"""

from __future__ import annotations

import torch

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)


def _declared(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def declare() -> torch.library.Library | None:
    """Declare the schemas no loaded library declared; returns the library holding them (keep it alive)."""
    missing = [s for s in SCHEMAS if not _declared(s.split("(", 1)[0])]
    if not missing:
        return None
    library = torch.library.Library("torchvision", "DEF")
    for schema in missing:
        library.define(schema)
    return library


# Declared on import, before any test module imports torchvision; the library object must outlive the
# session (dropping it removes the declarations).
_LIBRARY = declare()
