"""The phrasing families of ``word_problems`` (``phrasings="families"``): 24 sentence patterns per operation.

A family is one way of telling ``a + b``, ``a - b`` (``a >= b``) or ``a * b`` (``a`` groups of ``b``):
its own context (shop, school, sports, cooking, travel, garden, money...), items, question form
(``How many ... now?``, ``What is the total ...``, ``Find ...``, ``How many more ... than ...``, the
question first, the passive voice) and, for ``*``, groups, rows, rate x time or price x count. Fields
of a sentence: ``{a}`` and ``{b}`` (the operands, always >= 2, so every noun after them is plural),
``{item}`` (a plural noun from the family's ``items``), ``{name}`` with its pronouns ``{he}`` /
``{He}`` / ``{him}`` / ``{his}``, and a second person ``{name2}``. Rendering and the family split:
:mod:`posttrain.envs.word_problem_phrasings`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    """One phrasing family: ``id`` (``add07``: the operation and a number), its ``sentences`` in order
    (the question among them) and ``items``, the plural nouns ``{item}`` is drawn from (empty when the
    sentences name their own)."""

    id: str
    op: str
    sentences: tuple[str, ...]
    items: tuple[str, ...] = ()


TOKENS = ("marbles", "stickers", "stamps", "buttons", "shells", "coins", "beads", "cards", "crayons", "erasers")
FOOD = ("apples", "oranges", "muffins", "cookies", "lemons", "carrots", "plums", "potatoes")
BAKED = ("cupcakes", "cookies", "muffins", "brownies", "pies")
FRUIT = ("apples", "strawberries", "plums", "tomatoes", "cherries", "peaches")
FLOWERS = ("roses", "tulips", "daisies", "sunflowers", "lilies")
PACKS = ("stickers", "cards", "pencils", "batteries", "balloons")
SCHOOL = ("pencils", "notebooks", "crayons", "markers", "rulers")


def _f(op: str, number: int, *sentences: str, items: tuple[str, ...] = ()) -> Family:
    return Family(f"{op}{number:02d}", op, tuple(sentences), items)


ADD = (
    _f("add", 1, "{name} had {a} {item}.", "{name2} gave {him} {b} more.", "How many {item} does {name} have now?",
       items=TOKENS),
    _f("add", 2, "There are {a} {item} in a box.", "{name} puts {b} more {item} into the box.",
       "How many {item} are in the box now?", items=TOKENS),
    _f("add", 3, "A shop sold {a} {item} in the morning and {b} {item} in the afternoon.",
       "How many {item} did the shop sell altogether?", items=FOOD),
    _f("add", 4, "{name} read {a} pages on Monday and {b} pages on Tuesday.",
       "What is the total number of pages {he} read?"),
    _f("add", 5, "In the first half, the team scored {a} points.", "In the second half, it scored {b} points.",
       "How many points did the team score in the whole game?"),
    _f("add", 6, "How many {item} are there in all if {name} has {a} {item} and {name2} has {b} {item}?",
       items=TOKENS),
    _f("add", 7, "On Saturday the family drove {a} miles.", "On Sunday they drove {b} miles.",
       "How many miles did they drive over the weekend?"),
    _f("add", 8, "{a} {item} were picked by {name} and {b} {item} were picked by {name2}.",
       "How many {item} were picked in total?", items=FRUIT),
    _f("add", 9, "A baker uses {a} eggs for a cake and {b} eggs for a batch of cookies.",
       "How many eggs does the baker use?"),
    _f("add", 10, "{name} saved {a} dollars last week and {b} dollars this week.",
       "Find how many dollars {name} saved in the two weeks."),
    _f("add", 11, "A bus has {a} passengers.", "At the next stop, {b} more passengers get on.",
       "How many passengers are on the bus now?"),
    _f("add", 12, "{name} counted {a} red cars and {b} blue cars in the parking lot.",
       "How many cars did {he} count altogether?"),
    _f("add", 13, "The library got {a} new books in March.", "In April it got another {b}.",
       "How many new books did the library get in these two months?"),
    _f("add", 14, "{name} keeps {a} {item} in one bag and {b} {item} in another bag.",
       "How many {item} does {he} have in both bags?", items=TOKENS),
    _f("add", 15, "A farmer has {a} cows and {b} sheep.", "How many animals does the farmer have in total?"),
    _f("add", 16, "There were {a} children at the pool.", "Then {b} more children arrived.",
       "How many children were at the pool after that?"),
    _f("add", 17, "What is the total number of {item} if one basket holds {a} {item} and a second basket holds "
       "{b} {item}?", items=FOOD),
    _f("add", 18, "{name} scored {a} goals this season and {name2} scored {b} goals.",
       "Together, how many goals did the two players score?"),
    _f("add", 19, "At the bake sale, {name} sold {a} {item}.", "{name2} sold {b} {item}.",
       "How many {item} did they sell together?", items=BAKED),
    _f("add", 20, "A train travels {a} miles to the first station and {b} miles more to the second station.",
       "How many miles does it travel in all?"),
    _f("add", 21, "{name}'s garden has {a} {item}.", "{He} plants {b} more {item}.",
       "How many {item} are in the garden now?", items=FLOWERS),
    _f("add", 22, "The class collected {a} cans on the first day of the food drive and {b} cans on the second day.",
       "How many cans did the class collect?"),
    _f("add", 23, "{name} practiced the piano for {a} hours last week and {b} hours this week.",
       "How many hours did {he} practice in total?"),
    _f("add", 24, "{name} has {a} {item}.", "{name2} has {b} more {item} than {name}.",
       "How many {item} does {name2} have?", items=TOKENS),
)

SUB = (
    _f("sub", 1, "{name} had {a} {item}.", "{He} gave {b} {item} to {name2}.", "How many {item} does {name} have left?",
       items=TOKENS),
    _f("sub", 2, "There were {a} {item} on the table.", "{name} ate {b} of them.",
       "How many {item} are still on the table?", items=BAKED),
    _f("sub", 3, "A shop had {a} {item} in stock.", "It sold {b} {item} today.",
       "How many {item} are left in the shop?", items=FOOD),
    _f("sub", 4, "{name} needs to read {a} pages.", "{He} has already read {b} pages.",
       "How many pages does {he} still have to read?"),
    _f("sub", 5, "A bus had {a} passengers.", "At the stop, {b} passengers got off.",
       "How many passengers are on the bus now?"),
    _f("sub", 6, "How many {item} remain if {name} starts with {a} {item} and loses {b} of them?", items=TOKENS),
    _f("sub", 7, "A trip is {a} miles long.", "The family has already driven {b} miles.",
       "How many miles do they still have to drive?"),
    _f("sub", 8, "{name} had {a} dollars.", "{He} spent {b} dollars on lunch.",
       "How many dollars does {he} have left?"),
    _f("sub", 9, "{a} {item} were baked for the party.", "{b} of them were eaten.", "How many {item} were not eaten?",
       items=BAKED),
    _f("sub", 10, "{name2} has {a} {item} and {name} has {b} {item}.",
       "How many more {item} does {name2} have than {name}?", items=TOKENS),
    _f("sub", 11, "A baker made {a} loaves of bread.", "By noon, {b} loaves were sold.",
       "How many loaves were not sold by noon?"),
    _f("sub", 12, "Find the number of {item} left when {b} {item} are taken away from a pile of {a} {item}.",
       items=TOKENS),
    _f("sub", 13, "The school choir has {a} singers.", "{b} of them are boys.", "How many girls are in the choir?"),
    _f("sub", 14, "{name} picked {a} {item}.", "{b} of them were bad, so {he} threw them away.",
       "How many good {item} does {he} have?", items=FRUIT),
    _f("sub", 15, "A parking lot has {a} spaces.", "{b} spaces are taken.", "How many spaces are free?"),
    _f("sub", 16, "There were {a} birds in a tree.", "{b} birds flew away.", "How many birds are still in the tree?"),
    _f("sub", 17, "{name} is saving for a bike that costs {a} dollars.", "{He} has {b} dollars so far.",
       "How many more dollars does {he} need?"),
    _f("sub", 18, "A book has {a} chapters.", "{name} has finished {b} chapters.",
       "How many chapters are left to read?"),
    _f("sub", 19, "The team played {a} games this season and won {b} of them.",
       "How many games did the team not win?"),
    _f("sub", 20, "{a} children signed up for the trip, but {b} of them were sick on the day.",
       "How many children went on the trip?"),
    _f("sub", 21, "{name} baked {a} {item} and gave {b} {item} to {his} neighbors.",
       "How many {item} does {name} have now?", items=BAKED),
    _f("sub", 22, "A ribbon is {a} inches long.", "{name} cuts off {b} inches.",
       "How many inches long is the ribbon now?"),
    _f("sub", 23, "At the start of the game, {name} had {a} {item}.", "{He} lost {b} {item} during the game.",
       "How many {item} did {he} have at the end?", items=TOKENS),
    _f("sub", 24, "Out of {a} tickets, {b} tickets were sold before the show.", "How many tickets were not sold?"),
)

MUL = (
    _f("mul", 1, "{name} has {a} bags.", "Each bag holds {b} {item}.", "How many {item} does {name} have in all?",
       items=TOKENS),
    _f("mul", 2, "A hall has {a} rows of chairs with {b} chairs in each row.", "How many chairs are in the hall?"),
    _f("mul", 3, "{name} reads {b} pages every day.", "How many pages does {he} read in {a} days?"),
    _f("mul", 4, "One ticket costs {b} dollars.", "How many dollars do {a} tickets cost?"),
    _f("mul", 5, "There are {a} teams in a tournament, and each team has {b} players.",
       "How many players are there altogether?"),
    _f("mul", 6, "How many {item} are there if {a} boxes each contain {b} {item}?", items=TOKENS),
    _f("mul", 7, "A bookshelf has {a} shelves.", "There are {b} books on each shelf.",
       "How many books are on the bookshelf?"),
    _f("mul", 8, "{name} runs {b} laps every day for {a} days.", "How many laps does {he} run in total?"),
    _f("mul", 9, "A car travels {b} miles every hour.", "How many miles does it travel in {a} hours?"),
    _f("mul", 10, "A recipe uses {b} eggs for one cake.", "How many eggs are needed for {a} cakes?"),
    _f("mul", 11, "{a} children each bring {b} {item} to class.",
       "How many {item} do the children bring in total?", items=SCHOOL),
    _f("mul", 12, "A garden has {a} rows of {item}, with {b} {item} in each row.",
       "Find the number of {item} in the garden.", items=FLOWERS),
    _f("mul", 13, "{name} buys {a} packs of {item}.", "Each pack has {b} {item}.",
       "What is the total number of {item} {he} buys?", items=PACKS),
    _f("mul", 14, "A worker earns {b} dollars an hour.", "How many dollars does the worker earn in {a} hours?"),
    _f("mul", 15, "{b} {item} were placed on each of {a} plates.",
       "How many {item} were placed on the plates altogether?", items=BAKED),
    _f("mul", 16, "There are {a} vans, and each van carries {b} people.", "How many people do the vans carry in all?"),
    _f("mul", 17, "{name} saves {b} dollars each week.", "How many dollars will {he} have saved after {a} weeks?"),
    _f("mul", 18, "A box of crayons has {b} crayons.", "How many crayons are in {a} such boxes?"),
    _f("mul", 19, "Each table in a restaurant seats {b} people.", "The restaurant has {a} tables.",
       "How many people can sit at the tables?"),
    _f("mul", 20, "{name} made {a} sandwiches and cut each one into {b} pieces.",
       "How many pieces did {he} end up with?"),
    _f("mul", 21, "A farmer puts {b} {item} in each basket and fills {a} baskets.",
       "How many {item} did the farmer put in the baskets?", items=FOOD),
    _f("mul", 22, "A pencil costs {b} cents.", "{name} buys {a} pencils.", "How many cents does {he} spend?"),
    _f("mul", 23, "A class is split into {a} groups of {b} students.", "How many students are in the class?"),
    _f("mul", 24, "A machine makes {b} toys every minute.", "How many toys does it make in {a} minutes?"),
)

FAMILIES: dict[str, tuple[Family, ...]] = {"add": ADD, "sub": SUB, "mul": MUL}
"""op -> its phrasing families, in id order."""
