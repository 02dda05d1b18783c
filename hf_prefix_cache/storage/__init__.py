"""Where stored states live: segments of shared runs, host, disk and remote tiers, placement, budgets."""
