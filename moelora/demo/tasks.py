"""The demo's synthetic tasks: what the bundled base model and each bundled adapter compute.

Pure Python (no torch, no transformers), so tests can check generated text against the exact
expected answer. An input is a line of 3-6 random lowercase "words" of 2-7 letters joined by single
spaces. The base model copies the line; each adapter applies one whole-line transformation, so
every output token depends on the input.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

MIN_WORDS, MAX_WORDS = 3, 6
MIN_LETTERS, MAX_LETTERS = 2, 7
HELDOUT_SEED = 20250  # default held-out inputs; scripts/train_demo.py kept the first 10_000 out of training

IM_START, IM_END, ENDOFTEXT, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"


def copy(text: str) -> str:
    """The base model's task: the line itself."""
    return text


def upper(text: str) -> str:
    """The `upper` adapter: the line in capitals."""
    return text.upper()


def reverse(text: str) -> str:
    """The `reverse` adapter: the words in reverse order (letters inside a word unchanged)."""
    return " ".join(reversed(text.split(" ")))


def _shift_char(ch: str) -> str:
    for alphabet in (string.ascii_lowercase, string.ascii_uppercase):
        i = alphabet.find(ch)
        if i >= 0:
            return alphabet[(i + 1) % 26]
    return ch


def shift(text: str) -> str:
    """The `shift` adapter: every letter moved one place on (z -> a); other characters kept."""
    return "".join(_shift_char(ch) for ch in text)


TASKS: tuple[str, ...] = ("copy", "upper", "reverse", "shift")
ADAPTERS: tuple[str, ...] = ("upper", "reverse", "shift")  # `copy` is the base model, no adapter


def transform(task: str, text: str) -> str:
    """The expected answer of `task` (one of TASKS) for input `text`."""
    fns: dict[str, Callable[[str], str]] = {"copy": copy, "upper": upper, "reverse": reverse, "shift": shift}
    if task not in fns:
        raise ValueError(f"unknown demo task {task!r}; expected one of {TASKS}")
    return fns[task](text)


def random_input(rng: random.Random) -> str:
    """One input line drawn from `rng` (the distribution the demo model was trained on)."""
    n_words = rng.randint(MIN_WORDS, MAX_WORDS)
    words = (
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_LETTERS, MAX_LETTERS)))
        for _ in range(n_words)
    )
    return " ".join(words)


def heldout_inputs(n: int, seed: int = HELDOUT_SEED) -> list[str]:
    """`n` deterministic input lines from `seed`; the same (n, seed) always gives the same list.

    With the default seed, the first 10_000 lines were excluded from training; any other seed
    gives lines that training almost surely never saw (the input space has ~26**20 members).
    """
    rng = random.Random(seed)
    return [random_input(rng) for _ in range(n)]


def user_prompt(text: str) -> str:
    """The prompt string for one user message, as the bundled chat template renders it with
    add_generation_prompt=True. Generation stops at <|im_end|> (the model's eos token)."""
    return f"{IM_START}user\n{text}{IM_END}\n{IM_START}assistant\n"
