"""Write your own tool environment (docs/tasks_and_verifiers.md, "Write your own tool environment").

A shop whose prices only a tool knows: the model must look them up, then answer the total.
"""

import random

from posttrain.envs.tool_calling import Tool, ToolEnv

PRICES = {f"item{i}": 10 + 7 * i for i in range(40)}


def price(item: str) -> str:
    """The tool's function: called with the arguments the model wrote; a raise is shown to the model."""
    if item not in PRICES:
        raise KeyError(f"no such item {item!r}")
    return str(PRICES[item])


PRICE = Tool(
    name="price",
    description="The price of an item, in cents.",
    parameters={"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
    fn=price,
)


def problem(seed: int) -> tuple[str, int]:
    """seed -> (first observation, the integer answer)."""
    rng = random.Random(seed)
    a, b = rng.sample(sorted(PRICES), 2)
    n = rng.randint(2, 5)
    return f"{n} x {a} + 1 x {b} = ? cents", n * PRICES[a] + PRICES[b]


def make_env(**kwargs) -> ToolEnv:
    """The factory a recipe names (env.name: examples.tool_env.shop:make_env); kwargs = env.kwargs."""
    return ToolEnv("shop", [PRICE], problem, **kwargs)
