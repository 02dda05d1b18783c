"""Reuse lost to media padding: where reuse stopped at a media item the store holds keyed with other padding.

Some towers read the padding a processor adds to a prompt's clips (Phi-4-multimodal's conformer): such
an item is keyed with its padding (`multimodal.media.MediaItem.unpadded`), so a clip re-padded by a longer
clip of a later prompt is computed again and reuse stops at its first placeholder. That is exact, but
it is reuse lost: where the store holds an item of the same content (`MediaItem.content`) right there,
under other padding (or none), the request counts `media_padding` as reduced reuse (the caller records
it with the request's other reductions), and the tokens the store holds past that point are logged.
"""

from __future__ import annotations

import logging

from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.multimodal.media import MediaLayout, item_symbols, symbol_content
from hf_prefix_cache.store.contract import Lease, Store

logger = logging.getLogger("hf_prefix_cache")


def media_padding_loss(store: Store, key: PrefixKey, layout: MediaLayout, lease: Lease) -> int | None:
    """What reuse lost if it stopped at an item the store holds there with other padding (`media_padding`).

    Returns:
        The prompt tokens past the item's start that the store holds with that item as stored
        (what the request could have reused, had its padding been the stored one); None when reuse
        did not stop at such an item (nothing to count).
    """
    item = next((i for i in layout.items if i.start == lease.matched_len), None)
    if item is None:
        return None
    symbols = list(key.symbols)
    head, own = symbols[: item.start], symbols[item.start]
    for stored in store.next_symbols(key.namespace, head):
        if stored == own or not isinstance(stored, int) or symbol_content(stored) != (item.kind, item.content):
            continue  # this request's own item (stored since), another item, or text: nothing lost to padding
        probe = [*head, *item_symbols(stored, item.end - item.start), *symbols[item.end :]]
        lost = min(store.stored_len(key.namespace, probe), len(symbols) - 1) - item.start
        logger.debug(
            "prefix cache: reuse stopped at the %s at %d, stored with other padding: %d more tokens were stored",
            item.kind,
            item.start,
            lost,
        )
        return lost
    return None
