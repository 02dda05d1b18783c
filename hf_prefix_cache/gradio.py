"""Launch the Gradio chat: ``python -m hf_prefix_cache.gradio`` (see `frontends/gradio_app.py`)."""

from __future__ import annotations

if __name__ == "__main__":
    from hf_prefix_cache.frontends.gradio_app import main

    main()
