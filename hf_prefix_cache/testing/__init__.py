"""Model builders and comparisons shared by the tests, the benchmarks, the scripts and the front ends.

Tiny random-weight models of every cache layer type (`tiny_models.py`), tiny media models with
their inputs (`tiny_vlms.py`, `tiny_qwen_media.py`, the family tables in `media/`), real
checkpoint shapes (`real_configs.py`) and the cold-versus-cached comparison (`compare.py`).
The package core never imports this layer; the front ends may.
"""
