"""Launch the Gradio chat: ``python -m hf_prefix_cache.gradio`` (see `frontends/gradio_app.py`).

The same as ``hf-prefix-cache gradio``: without gradio or the real model it prints one line
naming what to install and exits with status 2.
"""

from __future__ import annotations

if __name__ == "__main__":
    import sys

    from hf_prefix_cache.frontends.cli import main

    sys.exit(main(["gradio", *sys.argv[1:]]))
