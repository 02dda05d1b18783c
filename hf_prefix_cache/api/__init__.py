"""What users import: `PrefixCache`, and the loader of the real test model (`models.py`)."""
