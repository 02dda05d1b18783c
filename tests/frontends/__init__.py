"""The CLI, the demo, the Gradio chat, the server and the notebooks (hf_prefix_cache/frontends)."""
