"""The placeholder and framing ids of the tiny generic families, shared by their builders and their media.

Framing ids are 110-119, placeholders 120-126; generated answers never contain ids above 99
(`SPECIAL_IDS` are suppressed).
"""

from __future__ import annotations

IMG, VID, AUD = 120, 121, 126
BREAK, END = 112, 113
SPECIAL_IDS = list(range(100, 128))
