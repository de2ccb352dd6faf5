"""Prompts for speculative decoding on the default model: extraction-style (the answer quotes the
prompt) and free text. Shared by tests/engine/test_spec_decode_real_model.py and
benchmarks/spec_decode.py."""
from __future__ import annotations

DOCUMENTS = [
    "The meeting is on Tuesday, March 4th at 10:30 in room 214 of the Jefferson building. Bring the "
    "quarterly report and the signed contract from Acme Corporation.",
    "Order 55812 was shipped on June 2nd to Maria Lopez, 18 Harbor Street, Portland, Oregon. The package "
    "contains two blue ceramic mugs and one wooden serving tray.",
    "Dr. Alan Reed will present the results of the clinical trial at the Boston conference on September "
    "14th. The trial enrolled 420 patients across nine hospitals.",
    "The new library opens on Monday at 9 in the morning. It has a reading room, a children's corner, "
    "forty public computers and a cafe on the second floor.",
    "Invoice 2231 from Green Valley Farms lists 30 crates of apples, 12 crates of pears and 8 boxes of "
    "honey, due for payment by the end of April.",
    "The train to Edinburgh leaves platform 6 at 14:05 and arrives at 18:40. First class passengers can "
    "use the lounge next to the ticket office.",
    "Our team finished the database migration on Friday night. All customer records were copied, the old "
    "servers were switched off, and backups run every six hours.",
    "The recipe needs two cups of flour, one cup of sugar, three eggs, a teaspoon of vanilla and half a "
    "cup of melted butter, baked for thirty minutes.",
]
EXTRACTION_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word: ",
    "Copy this text without changing anything: ",
]
FREE_TEXT_QUESTIONS = [
    "Write a short story about a dragon who learns to cook.", "Give me three tips for staying healthy.",
    "Explain photosynthesis to a child.", "Write a poem about the autumn wind.",
    "Describe your ideal weekend.", "What makes a good teacher?",
    "Write a letter to a friend about a trip to the mountains.", "Why is the sky blue?",
]


def extraction_messages() -> list[str]:
    return [EXTRACTION_INSTRUCTIONS[i % 2] + doc for i, doc in enumerate(DOCUMENTS)]


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
