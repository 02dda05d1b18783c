"""The README's python examples run as written, and what it copies from elsewhere is current.

The text example loads the real SmolLM2-135M-Instruct (skipped with the loader's reason where it
cannot be loaded); the image example the tiny random-weight LLaVA with its real processor. Each
runs in a fresh namespace, exactly as a reader would paste it, and the test then checks what the
example's comments promise.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hf_prefix_cache import ModelUnavailableError

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
SUMMARY = re.compile(r"^\| mapping \|.*?\n(?!\|)", flags=re.S | re.M)


def _run(block: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    try:
        exec(compile(block, "README.md", "exec"), namespace)
    except ModelUnavailableError as exc:
        pytest.skip(f"the real model cannot be loaded here: {exc}")
    namespace["store"].detach()
    return namespace


def _block(loader: str) -> str:
    found = [b for b in BLOCKS if loader in b]
    assert len(found) == 1, f"expected one README python block calling {loader}, found {len(found)}"
    return found[0]


def test_the_readme_has_exactly_a_text_and_an_image_example() -> None:
    """The README's python blocks are the text example and the image example, nothing else to go stale."""
    assert len(BLOCKS) == 2, BLOCKS
    assert {_block("load_smollm2()"), _block("load_tiny_vlm()")} == set(BLOCKS)


def test_the_readme_stays_a_doorway() -> None:
    """The README stays under 200 lines; the rest belongs on the documentation site (docs/)."""
    assert len(README.splitlines()) < 200


def test_the_text_example_reuses_the_first_turn() -> None:
    """The README's text example runs on the real SmolLM2, and its second turn reuses the whole first one."""
    namespace = _run(_block("load_smollm2()"))
    stats = namespace["store"].stats()
    first_prompt_len = len(
        namespace["tokenizer"].apply_chat_template(
            namespace["messages"][:1], add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    assert stats.requests == 2 and stats.hit_requests == 1 and not stats.fallbacks, stats
    assert stats.hit_tokens >= first_prompt_len, (stats.hit_tokens, first_prompt_len)
    assert len(namespace["messages"]) == 4 and all(m["content"] for m in namespace["messages"])


def test_the_image_example_reuses_the_image() -> None:
    """The README's image example runs on the tiny VLM, and its second turn reuses the stored image (16 tokens)."""
    namespace = _run(_block("load_tiny_vlm()"))
    stats = namespace["store"].stats()
    assert stats.requests == 2 and not stats.fallbacks, stats
    assert stats.hit_tokens_by_modality.get("image") == 16, stats.hit_tokens_by_modality


def test_the_support_summary_is_the_generated_one() -> None:
    """The README's support summary table is the one in the generated docs/support.md."""
    ours = SUMMARY.search(README)
    generated = SUMMARY.search((ROOT / "docs" / "support.md").read_text())
    assert ours and generated
    assert ours.group(0) == generated.group(0), "copy the summary table of docs/support.md into the README"


def test_the_readme_links_resolve() -> None:
    """Every relative link and image in the README points at a file of the checkout (and an anchor it has)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), target
        if anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, (target, sorted(slugs))
