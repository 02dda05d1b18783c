"""Media adapters per model family, and the lookup from a model to its adapter.

One module per family (`llava`, `llava_next`, `llava_onevision`, `idefics`, `qwen_vl`, `qwen_audio`,
`qwen_omni`, `qwen3_omni`, `ernie4_5_vl`, `hunyuan_vl`, `hy_v4_vl`, `cosmos3_edge`, `glm4v`, `mllama`,
`gemma4`, `phi4`, `emu3`, `ovis2`, `moss`, `kosmos2_5`); the base class and shared helpers live in `base`.
Each family module registers its row in `registry` (its adapter, the model types it serves, its
own media kwargs); families of the common pattern (rows of a media kwarg scattered over
placeholders) are rows of `generic_table`, served by `generic.GenericMedia`, and registered from
there, as are the families left cold by name. Importing this package imports every module in it,
so every row is registered before any lookup. A tower-specific key (``"llava/pixtral"``) wins over
the family's model type. A family missing from the registry runs cold on media inputs, with the
reason `media_inputs:<model_type>`.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from hf_prefix_cache.multimodal import registry
from hf_prefix_cache.multimodal.base import SHARED_MEDIA_KWARGS, MediaAdapter

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: Every kwarg that carries media or media bookkeeping: a call passing one a model's adapter does not
#: handle runs cold. The shared ones first, then each registered family's own.
MEDIA_KWARGS = registry.media_kwargs(SHARED_MEDIA_KWARGS)

__all__ = ["MEDIA_KWARGS", "MediaAdapter", "media_adapter_for"]


def media_adapter_for(model: Any) -> MediaAdapter | None:
    """The adapter of `model`'s family, or None when its media cannot be served exactly."""
    key = registry.family_key(model.config)
    build = registry.FAMILIES[key].adapter if key is not None else None
    return build(model) if build is not None else None
