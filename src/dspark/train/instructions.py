"""Instruction prompts for chat-target drafter data, built offline and deterministically.

Training prompts (``instructions_train.jsonl``) come from three generators that share no text with the
held-out bench sets:

* code: one task per public function of a fixed list of standard-library modules, written from the first
  sentence of its docstring ("Write a Python function ``name(args)`` that <summary>");
* math: word problems from templates with random names, items and numbers (the answer is not given);
* chat: open questions from templates × topics (explain, compare, give tips, write a short text).

The held-out sets (``heldout_code.jsonl``, ``heldout_math.jsonl``, ``heldout_chat.jsonl``) are hand-written
below: their code tasks name no standard-library function, their math problems use templates the training
generator does not have, and their chat topics are not in the training topic list. :func:`check_disjoint`
asserts that no held-out prompt appears in the training set.

Every line is ``{"messages": [{"role": "user", "content": ...}], "domain": ...}``; the target's own chat
template is applied when the prompts are tokenized.

Regenerate: ``python -m dspark.train.instructions --out src/dspark/assets/prompts``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

from dspark.cli_common import add_seed_arg

TRAIN_FILE = "instructions_train.jsonl"
HELDOUT_FILES = {"code": "heldout_code.jsonl", "math": "heldout_math.jsonl", "chat": "heldout_chat.jsonl"}

# ---- code tasks from standard-library docstrings -------------------------------------------------------

CODE_MODULES = (
    "string", "textwrap", "difflib", "re", "datetime", "calendar", "collections", "heapq", "bisect", "statistics",
    "math", "cmath", "random", "itertools", "functools", "operator", "os.path", "posixpath", "shutil", "glob",
    "fnmatch", "csv", "json", "base64", "binascii", "hashlib", "hmac", "secrets", "zlib", "gzip", "html",
    "urllib.parse", "ipaddress", "uuid", "fractions", "decimal", "copy", "pprint", "reprlib", "enum", "graphlib",
    "shlex", "tokenize", "keyword", "unicodedata", "locale", "gettext", "email.utils", "mimetypes", "colorsys",
    "quopri", "uu", "wave", "zipfile", "tarfile", "tempfile", "filecmp", "linecache", "inspect", "ast", "dis",
    "typing", "dataclasses", "contextlib", "abc", "numbers", "array", "struct", "codecs", "platform", "time",
    "sched", "queue", "threading", "subprocess", "socket", "selectors", "http.cookies", "wsgiref.util",
    "xml.sax.saxutils", "plistlib", "configparser", "argparse", "logging", "warnings", "traceback", "pathlib",
    "stat", "sqlite3", "zoneinfo", "ntpath", "genericpath", "imghdr", "sndhdr", "netrc", "tomllib",
)  # fmt: skip

CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that {summary}",
    "Implement `{name}{sig}` in Python: it {summary} Include a docstring.",
    "Write a Python function named `{name}` that {summary} Add type hints and a short example.",
    "How would you write a function `{name}{sig}` that {summary} Show the code.",
    "In Python, {lsummary} Write a function `{name}{sig}` that does this without using the `{module}` module.",
    "Explain what `{module}.{name}` does and write a small example that uses it.",
)

_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)", re.DOTALL)


def _summary(doc: str) -> str | None:
    """First sentence of a docstring, as a lower-case clause ending in a period; None when unusable."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = _SENTENCE.match(para)
    text = (m.group(1) if m else para).strip()
    if not 12 <= len(text) <= 220 or text.startswith(("(", "-", "*", ">>>")):
        return None
    if "->" in text or "=" in text or "(" in text.split()[0]:  # a signature line, not a sentence
        return None
    first = text.split()[0]
    if not first.isupper():  # keep acronyms ("HTML", "URL") as written
        text = text[0].lower() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def _signature(fn: object) -> str:
    try:
        sig = str(inspect.signature(fn))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    return sig if len(sig) <= 80 and " at 0x" not in sig else "(...)"  # no memory addresses (not reproducible)


def stdlib_functions() -> Iterator[tuple[str, str, str, str]]:
    """(module, function name, signature, summary) for each documented public function of CODE_MODULES."""
    for mod_name in CODE_MODULES:
        try:
            with warnings.catch_warnings():  # uu, imghdr, sndhdr are deprecated (still documented in 3.11)
                warnings.simplefilter("ignore", DeprecationWarning)
                mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            summary = _summary(inspect.getdoc(obj) or "")
            if summary:
                yield mod_name, name, _signature(obj), summary


def code_prompts(rng: random.Random) -> list[str]:
    """Two differently phrased tasks per stdlib function."""
    out = []
    for module, name, sig, summary in stdlib_functions():
        for template in rng.sample(CODE_TEMPLATES, 2):
            ls = summary[0].upper() + summary[1:]
            out.append(template.format(module=module, name=name, sig=sig, summary=summary, lsummary=ls))
    return out


# ---- math word problems --------------------------------------------------------------------------------

NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kemi", "Liam", "Maya",
    "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yara", "Zoe",
)  # fmt: skip
ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "books", "stamps", "seashells", "cards", "eggs")
MATH_TEMPLATES = (
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
    "A box holds {x} {item}. How many {item} are there in {y} boxes if {z} {item} are removed from the total?",
    "{a} buys {x} {item} at ${p} each and pays with a ${big} bill. How much change does {a} get?",
    "{a} reads {x} pages a day for {y} days and then {z} pages on the last day. How many pages did {a} read?",
    "A train travels at {s} km/h for {h} hours and then at {s2} km/h for {h2} hours. How far does it go in total?",
    "{a} saves ${x} each week. After {y} weeks {a} spends ${z}. How much money is left?",
    "There are {x} students in a class. {pct}% of them walk to school. How many students do not walk to school?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} and {b} share {x} {item} in the ratio {r1}:{r2}. How many {item} does each of them get?",
    "A shop sells a jacket for ${big}. During a sale the price drops by {pct}%. What is the sale price?",
    "{a} is {y} years old. {b} is {x} years older than twice {a}'s age. How old is {b}?",
    "A tank holds {big} liters. It leaks {y} liters per hour. How many liters are left after {h} hours?",
    "{a} runs {x} laps of a {s}-meter track. How many kilometers does {a} run?",
    "A recipe needs {y} eggs for {x} cookies. How many eggs are needed for {z} batches of {x} cookies?",
    "{a} has {x} {item} and wants to put them into bags of {y}. How many full bags can {a} make and how many "
    "{item} are left over?",
    "The sum of two numbers is {big} and their difference is {x}. What are the two numbers?",
)
MATH_SUFFIXES = ("", " Explain your reasoning step by step.", " Show your work.", " Answer with a short explanation.")


def math_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        r1, r2 = rng.sample(range(1, 8), 2)
        v = dict(
            a=a, b=b, item=rng.choice(ITEMS), x=rng.randint(3, 60), y=rng.randint(2, 15), z=rng.randint(1, 12),
            p=rng.randint(2, 9), big=rng.choice((20, 50, 100, 120, 200, 500)), s=rng.choice((40, 60, 80, 100, 400)),
            s2=rng.choice((30, 50, 70, 90)), h=rng.randint(2, 6), h2=rng.randint(1, 4),
            pct=rng.choice((10, 20, 25, 40, 60)), r1=r1, r2=r2,
        )  # fmt: skip
        out.append(rng.choice(MATH_TEMPLATES).format(**v) + rng.choice(MATH_SUFFIXES))
    return out


# ---- general chat ----------------------------------------------------------------------------------------

TOPICS = (
    "photosynthesis", "the water cycle", "compound interest", "black holes", "vaccines", "the stock market",
    "machine learning", "climate change", "the French Revolution", "plate tectonics", "the immune system",
    "renewable energy", "inflation", "the internet", "DNA", "gravity", "democracy", "the Roman Empire",
    "electric cars", "meditation", "sleep", "coffee", "recycling", "volcanoes", "the moon", "honeybees",
    "public transport", "cloud computing", "encryption", "the printing press", "rainbows", "earthquakes",
    "nutrition", "time zones", "the Olympic Games", "jazz music", "chess", "gardening", "bread baking",
    "budgeting", "remote work", "learning a language", "public speaking", "running", "photography",
    "the solar system", "antibiotics", "ocean tides", "supply and demand", "open source software",
    "3D printing", "batteries", "bird migration", "the Renaissance", "the human heart", "glaciers",
    "version control", "databases", "operating systems", "sorting algorithms", "recursion", "unit testing",
)  # fmt: skip
CHAT_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}? Give a short answer.",
    "Give me three interesting facts about {t}.",
    "Why is {t} important?",
    "Write a short paragraph about {t} for a ten-year-old.",
    "What are the most common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "How would you teach {t} to a beginner?",
    "List five questions a student might ask about {t}, with short answers.",
    "Compare {t} and {u}.",
    "What do {t} and {u} have in common?",
)


def chat_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        t, u = rng.sample(TOPICS, 2)
        out.append(rng.choice(CHAT_TEMPLATES).format(t=t, u=u))
    return out


# ---- held-out sets (hand-written; see the module docstring) ----------------------------------------------

HELDOUT_CODE = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that counts how many times each word appears in a text and returns a dictionary.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that removes duplicates from a list while keeping the original order.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit and back.",
    "Write a Python function that finds the largest and the smallest number in a list without using max or min.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that flattens a nested list of integers.",
    "Write a Python function that returns all the vowels in a string.",
    "Write a Python function that computes the factorial of a number recursively.",
    "Write a Python class `BankAccount` with deposit, withdraw and balance methods that refuses overdrafts.",
    "Write a Python function that checks whether two strings are anagrams of each other.",
    "Write a Python function that returns the second largest number in a list.",
    "Write a Python function that implements binary search on a sorted list.",
    "Write a Python function that reads a text file and returns the number of lines, words and characters.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Write a Python function that validates an email address with a simple regular expression.",
)
HELDOUT_MATH = (
    "A farmer has 17 cows and buys 8 more. Then 5 cows are sold. How many cows does the farmer have?",
    "Lena bakes 4 trays of muffins with 12 muffins on each tray. She sells 30 muffins. How many are left?",
    "A bike costs $240. Omar has saved $85 and earns $15 per week. How many weeks until he can buy the bike?",
    "A garden is 9 meters long and 6 meters wide. A fence goes all the way around it. How long is the fence?",
    "Three friends split a dinner bill of $72 equally and each adds a $4 tip. How much does each friend pay?",
    "A car uses 6 liters of fuel per 100 km. How much fuel does it need for a 350 km trip?",
    "Nina is 3 times as old as her brother. In 4 years she will be twice as old as him. How old is Nina now?",
    "A cinema has 18 rows of 24 seats. 390 tickets are sold. How many seats are empty?",
    "A phone is discounted from $400 to $340. What is the percentage discount?",
    "Tom walks 2.5 km to school and back every day for 5 days. How far does he walk in total?",
    "A pizza is cut into 8 slices. Maria eats 3 slices and Jon eats 2. What fraction of the pizza is left?",
    "A printer prints 45 pages per minute. How long does it take to print 1,260 pages?",
    "The average of four test scores is 82. Three of the scores are 75, 90 and 80. What is the fourth score?",
    "A water bottle holds 750 ml. How many bottles can be filled from a 12-liter jug?",
    "Sofia plants 5 rows of tulips with 14 tulips in each row. 9 tulips do not bloom. How many bloom?",
    "A train leaves at 9:45 and arrives at 13:20. How long is the journey?",
    "A rope 48 meters long is cut into pieces of 3.2 meters. How many pieces are there?",
    "Ali earns $18 per hour and works 7 hours a day, 5 days a week. How much does he earn in 4 weeks?",
    "A square has a perimeter of 36 cm. What is its area?",
    "A jar has red and blue marbles in the ratio 3:5. There are 40 marbles. How many are blue?",
)
HELDOUT_CHAT = (
    "What is the difference between weather and climate?",
    "Can you give me some tips for staying focused while studying?",
    "Why do cats purr?",
    "How do airplanes stay in the air?",
    "What should I pack for a weekend camping trip?",
    "Explain how a refrigerator keeps food cold.",
    "What are some good habits for a healthy morning routine?",
    "Write a short thank-you note to a teacher.",
    "Why is the sky blue?",
    "How can I make my small apartment feel bigger?",
    "What is the best way to learn to play the guitar as an adult?",
    "Describe a perfect autumn day in a few sentences.",
    "How do vaccines and antibiotics differ?",
    "What are the main causes of traffic jams in big cities?",
    "Give me a simple recipe for vegetable soup.",
    "How does a credit score work?",
    "Write a short story opening about a lighthouse keeper.",
    "What are the benefits of reading fiction?",
    "How do I politely decline an invitation to a party?",
    "Why do leaves change color in the fall?",
)
HELDOUT = {"code": HELDOUT_CODE, "math": HELDOUT_MATH, "chat": HELDOUT_CHAT}


# ---- files -----------------------------------------------------------------------------------------------


def training_prompts(seed: int = 0, num_math: int = 1200, num_chat: int = 1200) -> list[dict]:
    """All training rows, shuffled (so any prefix mixes the three domains), deduplicated."""
    rng = random.Random(seed)
    rows = [("code", p) for p in code_prompts(rng)]
    rows += [("math", p) for p in math_prompts(rng, num_math)]
    rows += [("chat", p) for p in chat_prompts(rng, num_chat)]
    seen: set[str] = set()
    unique = [(d, p) for d, p in rows if not (p in seen or seen.add(p))]
    rng.shuffle(unique)
    return [_row(p, d) for d, p in unique]


def _row(text: str, domain: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "domain": domain}


def check_disjoint(train: list[dict]) -> None:
    """Raise when a held-out prompt (or a held-out chat topic) appears in the training rows."""
    texts = {r["messages"][0]["content"] for r in train}
    for domain, prompts in HELDOUT.items():
        clash = texts.intersection(prompts)
        if clash:
            raise ValueError(f"held-out {domain} prompts are also training prompts: {sorted(clash)[:3]}")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_all(out_dir: str | Path, seed: int = 0) -> dict[str, int]:
    out = Path(out_dir)
    train = training_prompts(seed)
    check_disjoint(train)
    write_jsonl(out / TRAIN_FILE, train)
    counts = {TRAIN_FILE: len(train)}
    for domain, prompts in HELDOUT.items():
        write_jsonl(out / HELDOUT_FILES[domain], [_row(p, domain) for p in prompts])
        counts[HELDOUT_FILES[domain]] = len(prompts)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="src/dspark/assets/prompts", help="output directory")
    add_seed_arg(p, 0)
    args = p.parse_args(argv)
    for name, n in write_all(args.out, args.seed).items():
        print(f"{name}: {n} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
