"""What users import: `PrefixCache`, the real test model's loader (`models.py`), a real document (`sample_text.py`)."""
