"""The model side: adapters per transformers cache layer, the model profile, the working cache, its states."""
