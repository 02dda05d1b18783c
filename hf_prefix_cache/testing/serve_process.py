"""A server process on a free loopback port: ours (`hf-prefix-cache serve`) or `transformers serve`.

Used by the serve tests and `benchmarks/bench_serve.py`. Started offline (``HF_HUB_OFFLINE=1``),
one thread per process unless told otherwise, importing this checkout's package; `wait` polls
``/health`` and fails with the log's tail if the process dies or is slow. Also the small models and
images those servers are given: `tiny_chat_folder`, `tiny_hybrid_folder`, `tiny_vlm_folder`, `image_url`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_TRANSFORMERS_CLI = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """One server process. `ours=False` runs transformers' own ``transformers serve`` (no store)."""

    def __init__(
        self, model: str, *args: str, ours: bool = True, env: dict[str, str] | None = None, name: str = "serve"
    ) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix=f"hfpc-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        head = [sys.executable, "-m", "hf_prefix_cache", "serve"] if ours else [sys.executable, "-c", _TRANSFORMERS_CLI]
        if not ours:
            head.append("serve")
        command = [*head, model, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        environ = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT)
        self.command = command

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 240) -> ServeProcess:
        """Block until ``/health`` answers 200."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.command}\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout}s: {self.command}\n{self.tail()}")
            time.sleep(0.25)

    def client(self, timeout: float = 120, **kwargs: Any) -> Any:
        """An `openai.OpenAI` client of this server (no retries)."""
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout, **kwargs)

    def get(self, path: str) -> Any:
        """GET `path`: parsed JSON under ``/v1/``, text elsewhere."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            body = response.read().decode("utf-8")
        return json.loads(body) if path.startswith("/v1/") else body

    def store(self, check: bool = False) -> dict[str, Any]:
        """The one model's entry of ``/v1/cache/stats``: stats, budgets, pinned nodes (and integrity)."""
        data = self.get("/v1/cache/stats" + ("?check=true" if check else ""))["data"]
        assert len(data) == 1, data
        return dict(data[0])

    def tail(self, n: int = 4000) -> str:
        """The last `n` characters of the server's log."""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Terminate the server (kill it after 20 s) and delete its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def tiny_vlm_folder(path: Path) -> str:
    """The front ends' tiny random-weight LLaVA and its real processor (SmolLM2's tokenizer), saved to `path`."""
    from hf_prefix_cache.testing.chat_models import load_tiny_vlm

    model, processor = load_tiny_vlm()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def tiny_chat_folder(path: Path) -> str:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer and chat template, saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _saved_with_smollm2_tokenizer(
        path,
        LlamaForCausalLM,
        lambda tokenizer: LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            eos_token_id=tokenizer.eos_token_id,
        ),
    )


def tiny_hybrid_folder(path: Path) -> str:
    """A random-weight 3-layer Bamba [mamba2, attention, mamba2] with SmolLM2's tokenizer, saved to `path`."""
    from transformers import BambaConfig, BambaForCausalLM

    from hf_prefix_cache.testing.tiny_build import _ATTN, _MAMBA2

    return _saved_with_smollm2_tokenizer(
        path,
        BambaForCausalLM,
        lambda tokenizer: BambaConfig(
            vocab_size=len(tokenizer),
            num_hidden_layers=3,
            attn_layer_indices=[1],
            **_MAMBA2,
            **{**_ATTN, "max_position_embeddings": 8192},
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
        ),
    )


def _saved_with_smollm2_tokenizer(path: Path, model_class: Any, config_for: Callable[[Any], Any]) -> str:
    """A `model_class` of `config_for(SmolLM2's tokenizer)` with seed-0 random weights, saved with that tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from hf_prefix_cache.api.models import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_class(config_for(tokenizer)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def image_url(seed: int, size: int = 40) -> str:
    """A random RGB image as a PNG data URL, as OpenAI clients send images."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
