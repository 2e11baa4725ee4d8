"""Generates titan-train's embedded default dataset and tokenizer (committed next to this script).

The corpus is synthetic, written by us: short templated stories, arithmetic facts and ordered
sequences. It is varied enough not to be memorised in a few steps but regular enough that the
debug model's loss falls far below its starting value (ln 2048 ~ 7.6) within 200 steps.
The tokenizer is a byte-level BPE (vocab 2048, the debug model's vocab_size) trained on the
training split, with Llama-3-style BOS/EOS special tokens.

Run with the project's venv (`.venv/bin/python trainer/assets/make_default_data.py`); the output
is deterministic for a fixed seed.
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena",
         "Milo", "Nora", "Otto", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wren", "Zoe"]
ANIMALS = {"cat": "meows", "dog": "barks", "cow": "moos", "duck": "quacks", "sheep": "baas",
           "owl": "hoots", "frog": "croaks", "horse": "neighs", "lion": "roars", "bee": "buzzes",
           "pig": "oinks", "mouse": "squeaks"}
ADJS = ["small", "happy", "brave", "sleepy", "clever", "kind", "quiet", "curious", "tiny", "old",
        "young", "silly", "gentle", "busy"]
PLACES = ["village", "forest", "town", "garden", "farm", "valley", "castle", "harbor", "meadow",
          "city"]
LANDMARKS = ["river", "hill", "lake", "bridge", "mill", "market", "school", "well", "tower", "sea"]
ACTIVITIES = ["read a book", "play in the park", "bake bread", "sing a song", "paint a picture",
              "walk by the water", "climb a tree", "plant flowers", "fly a kite", "ride a bike"]
OBJECTS = {"red ball": "round and bright", "blue box": "heavy and locked", "old map": "torn at the edges",
           "golden key": "small and shiny", "green hat": "soft and warm", "silver bell": "loud and clear",
           "wooden boat": "light and fast", "yellow kite": "long and thin"}
FEELINGS = ["happy", "surprised", "proud", "excited", "calm", "glad"]
FRIENDS_DO = ["shared", "looked at", "played with", "talked about", "carried"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                "seventeen", "eighteen", "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "purple", "orange"]


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal = rng.choice(list(ANIMALS))
    adj = rng.choice(ADJS)
    place, landmark = rng.choice(PLACES), rng.choice(LANDMARKS)
    activity = rng.choice(ACTIVITIES)
    obj = rng.choice(list(OBJECTS))
    feeling = rng.choice(FEELINGS)
    day = rng.choice(DAYS)
    lines = [
        f"Once upon a time there was a {adj} {animal} named {name}.",
        f"{name} lived in a {place} near the {landmark}.",
        f"Every morning {name} liked to {activity}.",
        f"On {day}, {name} found a {obj} by the {landmark}.",
        f"The {obj} was {OBJECTS[obj]}.",
        f"{name} showed the {obj} to {friend}, and {friend} was {feeling}.",
        f"Together they {rng.choice(FRIENDS_DO)} the {obj} until the sun went down.",
        f"When it was dark, the {animal} {ANIMALS[animal]} and went home to sleep.",
    ]
    if rng.random() < 0.5:
        lines.insert(3, f"The {animal} {ANIMALS[animal]} when it is {feeling}.")
    return " ".join(lines)


def arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(4, 8)):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        if rng.random() < 0.5:
            facts.append(f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.")
        else:
            facts.append(f"{a} + {b} = {a + b}.")
    return " ".join(facts)


def sequence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        start = rng.randrange(len(DAYS))
        n = rng.randint(3, 10)
        seq = [DAYS[(start + i) % 7] for i in range(n)]
        return f"The days go {', '.join(seq)}."
    if kind == 1:
        start = rng.randrange(12)
        n = rng.randint(3, 12)
        seq = [MONTHS[(start + i) % 12] for i in range(n)]
        return f"The months go {', '.join(seq)}."
    if kind == 2:
        start = rng.randint(0, 10)
        n = rng.randint(3, 10)
        return "Counting: " + " ".join(NUMBER_WORDS[start + i] for i in range(n)) + "."
    color = rng.choice(COLORS)
    animal = rng.choice(list(ANIMALS))
    return f"What does the {color} {animal} say? The {color} {animal} {ANIMALS[animal]}."


def document(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        parts.append(story(rng) if r < 0.6 else arithmetic(rng) if r < 0.8 else sequence(rng))
    return "\n".join(parts)


def main() -> None:
    rng = random.Random(20260101)
    train = [document(rng) for _ in range(4000)]
    valid = [document(rng) for _ in range(200)]
    for split, docs in (("train", train), ("validation", valid)):
        with open(HERE / f"default_{split}.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train, trainer)
    tok.save(str(HERE / "tokenizer.json"))
    sizes = {p.name: p.stat().st_size for p in HERE.iterdir() if p.suffix in (".jsonl", ".json")}
    print(json.dumps({"vocab": tok.get_vocab_size(), "files": sizes}))


if __name__ == "__main__":
    main()
