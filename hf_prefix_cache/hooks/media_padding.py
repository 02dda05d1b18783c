"""Reuse lost to media padding: where reuse stopped at a media item the store holds keyed with other padding.

Some towers read the padding a processor adds to a prompt's clips (Phi-4-multimodal's conformer): such
an item is keyed with its padding (`multimodal.media.MediaItem.unpadded`), so a clip re-padded by a longer
clip of a later prompt is computed again and reuse stops at its first placeholder. That is exact, but
it is reuse lost: where the store holds an item of the same content (`MediaItem.content`) right there,
under other padding (or none), the request counts `media_padding` as reduced reuse, and the tokens the
store holds past that point are logged.
"""

from __future__ import annotations

import logging

from hf_prefix_cache import reasons
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.multimodal.media import MediaLayout, item_symbols, symbol_content
from hf_prefix_cache.store.contract import Lease, ReducedReuse, Store

logger = logging.getLogger("hf_prefix_cache")


def count_media_padding(store: Store, key: PrefixKey, layout: MediaLayout, lease: Lease) -> int:
    """Count `media_padding` if reuse stopped at an item stored there with other padding.

    Returns:
        The prompt tokens past the item's start that the store holds with that item as stored
        (what the request could have reused, had its padding been the stored one); 0 when not counted.
    """
    item = next((i for i in layout.items if i.start == lease.matched_len), None)
    if item is None:
        return 0
    symbols = list(key.symbols)
    head, own = symbols[: item.start], symbols[item.start]
    for stored in store.next_symbols(key.namespace, head):
        if stored == own or not isinstance(stored, int) or symbol_content(stored) != (item.kind, item.content):
            continue  # this request's own item (stored since), another item, or text: nothing lost to padding
        probe = [*head, *item_symbols(stored, item.end - item.start), *symbols[item.end :]]
        lost = min(store.stored_len(key.namespace, probe), len(symbols) - 1) - item.start
        store.record(ReducedReuse(reasons.MEDIA_PADDING))
        logger.debug(
            "prefix cache: reuse stopped at the %s at %d, stored with other padding: %d more tokens were stored",
            item.kind,
            item.start,
            lost,
        )
        return lost
    return 0
