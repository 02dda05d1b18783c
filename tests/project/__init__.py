"""The repository's documents: docstring examples, docs/structure.md, the README and docs/support.md."""
