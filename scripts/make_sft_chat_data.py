"""Write the chat dataset the `sft` and `smollm2_sft` recipes ship: posttrain/recipes/data/arithmetic_chat.jsonl.

320 short chats (``{"messages": [...]}``), deterministic (``random.Random(0)``), printable ASCII only (the
builtin char tokenizer's vocabulary): a user asks for a sum, a difference or a product of small numbers in
one of a few phrasings, and the assistant answers in one fixed format, ``"A + B = C. The answer is C."``.
A quarter of the chats have a second turn ("Now add 7." / "Now subtract 3." / "Now double it."), answered in
the same format from the first answer, so the data has multi-turn chats whose assistant turns are all
trained. Nothing is downloaded. Run from the repository root:

    .venv/bin/python scripts/make_sft_chat_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEST = Path("posttrain/recipes/data/arithmetic_chat.jsonl")
ROWS = 320

ASK = {
    "+": ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "How much is {a} and {b} together?"],
    "-": ["What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}.", "How much is {a} take away {b}?"],
    "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}.", "How much is {a} groups of {b}?"],
}
FOLLOW = {"+": "Now add {b}.", "-": "Now subtract {b}.", "*": "Now double it."}


def answer(a: int, op: str, b: int) -> tuple[str, int]:
    """``("a op b = c. The answer is c.", c)``."""
    c = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b} = {c}. The answer is {c}.", c


def operands(rng: random.Random, op: str) -> tuple[int, int]:
    """Two operands: sums of 0..99, differences with a non-negative result, products of 2..12."""
    if op == "*":
        return rng.randint(2, 12), rng.randint(2, 12)
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return (max(a, b), min(a, b)) if op == "-" else (a, b)


def chat(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One chat: a question and its answer, and in a quarter of them a follow-up question and its answer."""
    op = rng.choice("+-*")
    a, b = operands(rng, op)
    reply, c = answer(a, op, b)
    messages = [{"role": "user", "content": rng.choice(ASK[op]).format(a=a, b=b)},
                {"role": "assistant", "content": reply}]
    if rng.random() < 0.25:
        op2 = rng.choice("+-*")
        b2 = 2 if op2 == "*" else rng.randint(1, min(c, 20) if op2 == "-" and c > 0 else 20)
        if op2 == "-" and c < b2:
            op2 = "+"
        reply2, _ = answer(c, op2, b2)
        messages += [{"role": "user", "content": FOLLOW[op2].format(b=b2)}, {"role": "assistant", "content": reply2}]
    return {"messages": messages}


def main() -> None:
    """Write :data:`ROWS` chats to :data:`DEST`, one JSON object a line."""
    rng = random.Random(0)
    DEST.parent.mkdir(parents=True, exist_ok=True)
    with DEST.open("w", encoding="ascii") as f:
        for _ in range(ROWS):
            f.write(json.dumps(chat(rng)) + "\n")
    print(f"wrote {ROWS} chats to {DEST}")


if __name__ == "__main__":
    main()
