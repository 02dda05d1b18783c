"""The store: prefixes in a radix tree with tiers, pins, sessions and counters; it knows nothing of `generate`."""
