"""Where stored states live, as mechanism over one `Tier` protocol: segments, the device, host, disk and remote tiers.

Never imports the tree: which tier a node sits on is the store's placement policy (`store/placement.py`).
"""
