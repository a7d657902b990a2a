"""A deterministic corpus of short conversations the toy target is trained on.

Everything here is our own text: templated questions about arithmetic, counting, words
(spelled backwards, capitalised, letter counts), ordered lists, and facts about the
invented archipelago of Ostrel. Every assistant answer is a deterministic function of the
user prompt, so a small model can learn the corpus and a draft model can learn to predict
the toy target.

The corpus is generated, not shipped: the same ``(seed, n_conversations)`` always gives
the same conversations (only ``random.Random(seed).randrange`` and ``choice`` are used,
whose algorithms Python keeps stable), and the build hashes the generated text into the
toy target's recipe, so a change anywhere here rebuilds the target instead of silently
reusing stale weights.

The train/eval split is a function of the user text alone (a hash bucket), so the two
splits never share a prompt, whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Callable, Iterable

Conversation = dict  # {"messages": [{"role": ..., "content": ...}, ...]}

#: One conversation in EVAL_BUCKETS lands in the eval split.
EVAL_BUCKETS = 20

WORDS = (
    "apple", "river", "stone", "cloud", "lamp", "garden", "window", "candle", "forest", "bridge",
    "pencil", "rocket", "basket", "mirror", "island", "harbor", "lantern", "meadow", "pepper", "silver",
    "tiger", "violin", "wagon", "yellow", "zebra", "anchor", "button", "cactus", "dragon", "engine",
    "falcon", "ginger", "hammer", "igloo", "jacket", "kettle", "lemon", "magnet", "needle", "orange",
    "parrot", "quartz", "rabbit", "saddle", "tunnel", "umbrella", "valley", "walrus", "yogurt", "cobalt",
    "plum", "kite", "moss", "reed", "sand", "tide", "wolf", "bell", "coin", "drum",
)

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
COLORS = ("red", "orange", "yellow", "green", "blue", "indigo", "violet")
SEASONS = ("spring", "summer", "autumn", "winter")

# The invented archipelago of Ostrel: a fixed table of facts, part of the recipe.
ISLANDS = {
    "Kelmar": {"capital": "Vessa", "fruit": "plum", "flag": "green", "lighthouses": 3, "ruler": "Queen Ardis"},
    "Tolund": {"capital": "Brask", "fruit": "fig", "flag": "blue", "lighthouses": 5, "ruler": "King Oren"},
    "Mirrow": {"capital": "Elsin", "fruit": "pear", "flag": "red", "lighthouses": 2, "ruler": "Duke Pellam"},
    "Saffen": {"capital": "Quorn", "fruit": "lime", "flag": "white", "lighthouses": 7, "ruler": "Queen Ilse"},
    "Drevik": {"capital": "Holt", "fruit": "cherry", "flag": "black", "lighthouses": 4, "ruler": "King Tamsin"},
    "Ulvane": {"capital": "Merrow", "fruit": "quince", "flag": "gold", "lighthouses": 6, "ruler": "Lady Corra"},
    "Bransk": {"capital": "Tilde", "fruit": "apricot", "flag": "purple", "lighthouses": 1, "ruler": "Lord Fenn"},
    "Oskari": {"capital": "Runa", "fruit": "melon", "flag": "silver", "lighthouses": 8, "ruler": "Queen Maelis"},
}

SYSTEM_PROMPT = "You are the helpful archivist of Ostrel. Answer briefly."


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(100)
    op = rng.choice(("+", "-", "+"))
    value = a + b if op == "+" else a - b
    prompt = rng.choice(("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}, please."))
    return prompt.format(a=a, op=op, b=b), f"{a} {op} {b} = {value}."


def _counting(rng: random.Random) -> tuple[str, str]:
    start = rng.randrange(1, 60)
    stop = start + rng.randrange(2, 8)
    prompt = rng.choice(("Count from {a} to {b}.", "Please count from {a} up to {b}."))
    return prompt.format(a=start, b=stop), ", ".join(str(n) for n in range(start, stop + 1)) + "."


def _backwards(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(("Spell '{w}' backwards.", "Write the word '{w}' in reverse."))
    return prompt.format(w=word), f"'{word}' backwards is '{word[::-1]}'."


def _capitals(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(("Write '{w}' in capital letters.", "Shout the word '{w}'."))
    return prompt.format(w=word), f"{word.upper()}!"


def _letters(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(("How many letters are in '{w}'?", "Count the letters of '{w}'."))
    return prompt.format(w=word), f"'{word}' has {len(word)} letters."


def _lists(rng: random.Random) -> tuple[str, str]:
    name, items = rng.choice((("days of the week", DAYS), ("colors of the rainbow", COLORS),
                              ("seasons", SEASONS)))
    n = rng.randrange(2, len(items) + 1)
    if rng.randrange(2):
        return f"List the first {n} {name}.", ", ".join(items[:n]) + "."
    i = rng.randrange(len(items) - 1)
    return f"Which of the {name} comes after {items[i]}?", f"After {items[i]} comes {items[i + 1]}."


def _ostrel(rng: random.Random) -> tuple[str, str]:
    island = rng.choice(sorted(ISLANDS))
    facts = ISLANDS[island]
    key = rng.choice(sorted(facts))
    questions = {
        "capital": (f"What is the capital of {island}?", f"The capital of {island} is {facts['capital']}."),
        "fruit": (f"Which fruit grows on {island}?", f"On {island} the {facts['fruit']} grows best."),
        "flag": (f"What color is the flag of {island}?", f"The flag of {island} is {facts['flag']}."),
        "lighthouses": (f"How many lighthouses does {island} have?",
                        f"{island} has {facts['lighthouses']} lighthouses."),
        "ruler": (f"Who rules {island}?", f"{island} is ruled by {facts['ruler']}."),
    }
    prompt, answer = questions[key]
    if rng.randrange(3) == 0:
        prompt = "In Ostrel: " + prompt[0].lower() + prompt[1:]
    return prompt, answer


#: (task, weight): arithmetic has the largest space of distinct prompts, facts the smallest.
TASKS: tuple[tuple[Callable[[random.Random], tuple[str, str]], int], ...] = (
    (_arithmetic, 4), (_counting, 2), (_backwards, 2), (_capitals, 1), (_letters, 2), (_lists, 2), (_ostrel, 3),
)


def _pick_task(rng: random.Random) -> Callable[[random.Random], tuple[str, str]]:
    ticket = rng.randrange(sum(w for _, w in TASKS))
    for task, weight in TASKS:
        if ticket < weight:
            return task
        ticket -= weight
    raise AssertionError("unreachable")


def _conversation(rng: random.Random) -> Conversation:
    messages = []
    if rng.randrange(10) == 0:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    # One conversation in five has a second exchange, so multi-turn templates and
    # per-turn loss masks are exercised by the bundled data.
    for _ in range(2 if rng.randrange(5) == 0 else 1):
        prompt, answer = _pick_task(rng)(rng)
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def split_of(conversation: Conversation) -> str:
    """``"eval"`` or ``"train"``, decided by a hash of the conversation's user turns."""
    users = "\x00".join(m["content"] for m in conversation["messages"] if m["role"] == "user")
    bucket = int.from_bytes(hashlib.sha256(users.encode()).digest()[:4], "big") % EVAL_BUCKETS
    return "eval" if bucket == 0 else "train"


def generate_corpus(n_conversations: int, seed: int) -> dict[str, list[Conversation]]:
    """``n_conversations`` distinct conversations, split into ``{"train": [...], "eval": [...]}``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[Conversation]] = {"train": [], "eval": []}
    attempts = 0
    while len(seen) < n_conversations:
        attempts += 1
        if attempts > 50 * n_conversations:
            raise ValueError(f"cannot generate {n_conversations} distinct conversations; ask for fewer")
        conversation = _conversation(rng)
        key = json.dumps(conversation, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        splits[split_of(conversation)].append(conversation)
    return splits


def to_jsonl(conversations: Iterable[Conversation]) -> str:
    return "".join(json.dumps(c, ensure_ascii=False, sort_keys=True) + "\n" for c in conversations)


def write_corpus(splits: dict[str, list[Conversation]], directory: Path) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` into ``directory``; return their paths."""
    paths = {}
    for name, conversations in splits.items():
        paths[name] = Path(directory) / f"{name}.jsonl"
        paths[name].write_text(to_jsonl(conversations), encoding="utf-8")
    return paths


def corpus_digest(splits: dict[str, list[Conversation]]) -> str:
    """sha256 of the corpus text, part of the toy target's recipe hash."""
    digest = hashlib.sha256()
    for name in sorted(splits):
        digest.update(name.encode() + b"\n" + to_jsonl(splits[name]).encode())
    return digest.hexdigest()
