"""Front ends: the CLI, the Gradio chat and what they share. The package core never imports these.

`chat.py` runs one chat turn through a store and reports what the cache did (no UI library);
`gradio_app.py` is the Gradio UI over it; `tiny_vlm.py` names the random-weight VLM with a
real processor the app offers for images (built in `hf_prefix_cache.testing`); `engines.py` names
the models `gradio` and `terminal_chat.py` (the terminal chat) offer; `cli.py` is the
`hf-prefix-cache` command, with the parsers of `args.py`, which import no torch.
"""
