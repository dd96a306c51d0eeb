"""Verifiable tasks and rule-based rewards.

Built-in task ``arithmetic``: short multi-step word problems generated from a seed::

    Q: Kobira has 7 shells. They find 5 more. Then they give away 3. How many shells now?
    A: 7 + 5 = 12. 12 - 3 = 9. answer: 9<eos>

The prompt is everything up to and including ``A:``; the SFT target is the worked
solution; the reward only reads the final ``answer: N``. The held-out split is disjoint
from the training split by *arithmetic signature* (start value and operation list), so
eval problems are new calculations, not new wordings of training ones. Names are
made of random syllables so that a tokenizer trained on the corpus has plenty to learn
(vocabularies of 1024+ entries are real, and the top-20 of the sampling distribution
does not cover it).

Built-in task ``largest`` (for a pretrained chat model such as ``--model smollm2-135m``):
"Which number is the largest: 47, 12 or 83?" with three distinct numbers in 10..99,
asked through the chat template after a fixed system line and ``shots`` worked
examples (user/assistant turns, themselves generated from the seed and never from the
held-out split). The assistant's format is "The largest number is 83."; the reward
``first-number`` is 1 iff the first number the response writes is the answer (0
otherwise: no dense variant). The held-out split is disjoint by the unordered triple.

User task ``jsonl``: files of ``{"prompt": ..., "answer": ...}`` lines (optional
``"solution"`` for the SFT warm start, optional ``"system"`` for a system message when the
chat template is on), with any reward function by name or ``module:function``
(signature ``reward(response_text, answer) -> float``).
"""

from __future__ import annotations

import importlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .._validate import check_choice


#: bump when the generated problems change (part of the SFT cache key)
TASK_VERSION = 2


@dataclass(frozen=True)
class Problem:
    prompt: str  # fed to the model as is (or as the user turn, with the chat template)
    answer: str  # compared by the reward
    solution: str | None = None  # SFT target (the response), if known
    system: str | None = None  # system message (chat template only)
    shots: tuple = ()  # worked examples before the prompt: ((user, assistant), ...) (chat template only)

    def messages(self) -> list[dict]:
        """The chat of this problem: [system], the shots' turns, then the prompt as the user turn."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.shots:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return out + [{"role": "user", "content": self.prompt}]


@dataclass
class Task:
    name: str
    train: list[Problem]
    eval: list[Problem]


# ------------------------------------------------------------------ rewards
_ANSWER = re.compile(r"answer:\s*(-?\d+(?:\.\d+)?)")


def extract_answer(text: str) -> str | None:
    """The number after the last ``answer:`` in ``text``, or None."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


def answer_reward(response: str, answer: str) -> float:
    """1.0 iff the last ``answer: N`` in the response equals ``answer`` numerically."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    try:
        return 1.0 if float(got) == float(answer) else 0.0
    except ValueError:
        return 1.0 if got.strip() == str(answer).strip() else 0.0


def answer_format_reward(response: str, answer: str) -> float:
    """``answer_reward`` plus partial credit: 0.2 for a well-formed but wrong ``answer: N``.

    A shaped reward for very weak models (the smoke preset), where the exact answer is
    almost never right and a pure 0/1 reward would give no learning signal."""
    r = answer_reward(response, answer)
    return r if r > 0 else (0.2 if extract_answer(response) is not None else 0.0)


_EQUATION = re.compile(r"(-?\d+) ([+-]) (-?\d+) = (-?\d+)")


def steps_reward(response: str, answer: str) -> float:
    """``answer_reward``, every written equation ``a +/- b = c`` is true, and the answer is
    the last equation's result.

    With the final answer alone, samples whose wrong steps cancel out (``5 + 3 = 9.
    9 - 3 = 6``) are rewarded like correct ones (about 1 in 5 correct answers of the
    default SFT base at temperature 1), and RL then reinforces wrong arithmetic."""
    if answer_reward(response, answer) == 0.0:
        return 0.0
    eqs = _EQUATION.findall(response)
    for a, op, b, c in eqs:
        if (int(a) + int(b) if op == "+" else int(a) - int(b)) != int(c):
            return 0.0
    if eqs and float(eqs[-1][3]) != float(extract_answer(response)):
        return 0.0
    return 1.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_reward(response: str, answer: str) -> float:
    """1.0 iff the last number in the response equals ``answer``, whatever the wording.

    A format-blind diagnostic: with ``answer`` it separates getting the number right
    from writing it in the verifiable ``answer: N`` form."""
    nums = _NUMBER.findall(response)
    if not nums:
        return 0.0
    try:
        return 1.0 if float(nums[-1]) == float(answer) else 0.0
    except ValueError:
        return 0.0


def first_number_reward(response: str, answer: str) -> float:
    """1.0 iff the first number in the response equals ``answer`` (the ``largest`` task's reward).

    The first number, not any: "The largest is 83, not 47" is right, "47 is smaller than
    83" is wrong, so listing every candidate earns nothing."""
    m = _NUMBER.search(response)
    if m is None:
        return 0.0
    try:
        return 1.0 if float(m.group()) == float(answer) else 0.0
    except ValueError:
        return 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "answer": answer_reward, "answer+format": answer_format_reward, "answer+steps": steps_reward,
    "last-number": last_number_reward, "first-number": first_number_reward}


def get_reward(spec: str) -> Callable[[str, str], float]:
    """A reward by registry name (``answer``) or import path ``package.module:function``."""
    if ":" in spec and spec not in REWARDS:
        mod, _, fn = spec.partition(":")
        try:
            return getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward: cannot import {spec!r} ({e})") from e
    check_choice("reward", spec, (*REWARDS, "an import path module:function"))
    return REWARDS[spec]


# ------------------------------------------------------------------ arithmetic
_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "ch", "sh", "th", "br", "tr", "kl", "st", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ee", "oo", "ia", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "x"]
_OBJECTS = ["apples", "shells", "marbles", "coins", "stamps", "books", "pens", "cards", "stones",
            "beads", "kites", "cups", "eggs", "plums", "nuts", "ribbons", "buttons", "candles",
            "rocks", "leaves", "tickets", "boxes", "bottles", "feathers", "pebbles", "lemons",
            "flowers", "spoons", "keys", "toys", "bells", "maps", "hats", "socks", "seeds", "rings"]
_ADD = ["They find {x} more.", "They buy {x} more.", "A friend gives them {x} more.",
        "They pick up {x} more.", "They win {x} more.", "They make {x} more."]
_SUB = ["They give away {x}.", "They lose {x}.", "They sell {x}.", "They drop {x}.",
        "They trade away {x}.", "They use {x}."]
_THEN = ["", "Then ", "Later ", "Next "]


def _name(rng: random.Random) -> str:
    n = rng.choice((2, 2, 3))
    s = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)
    return s.capitalize()


def _story(rng: random.Random, max_number: int, n_steps: int) -> tuple[tuple, list[str], str]:
    """(signature, sentences, solution) of one problem; values stay in [0, 2 * max_number]."""
    cap = 2 * max_number
    a = rng.randint(1, max_number)
    sig, sents, sol = [a], [], []
    cur = a
    for _ in range(n_steps):
        can_add, can_sub = cur < cap, cur > 0
        add = can_add and (not can_sub or rng.random() < 0.5)
        x = rng.randint(1, min(max_number, cap - cur)) if add else rng.randint(1, min(max_number, cur))
        new = cur + x if add else cur - x
        tmpl = rng.choice(_ADD if add else _SUB).format(x=x)
        then = rng.choice(_THEN) if sents else ""
        sents.append(then + (tmpl[0].lower() + tmpl[1:] if then else tmpl))
        sol.append(f"{cur} {'+' if add else '-'} {x} = {new}.")
        sig.append(("+" if add else "-", x))
        cur = new
    return tuple(sig), sents, " " + " ".join(sol) + f" answer: {cur}"


def make_arithmetic_problem(rng: random.Random, *, max_number: int, min_steps: int, max_steps: int):
    """One (signature, Problem) from ``rng``."""
    name, obj = _name(rng), rng.choice(_OBJECTS)
    n_steps = rng.randint(min_steps, max_steps)
    sig, sents, sol = _story(rng, max_number, n_steps)
    text = f"{name} has {sig[0]} {obj}. " + " ".join(sents) + f" How many {obj} now?"
    answer = sol.rsplit("answer: ", 1)[1]
    return sig, Problem(prompt=f"Q: {text}\nA:", answer=answer, solution=sol)


def arithmetic_task(*, seed: int, train_size: int, eval_size: int, max_number: int = 20,
                    min_steps: int = 2, max_steps: int = 3) -> Task:
    """Train / held-out splits, disjoint by arithmetic signature, generated from ``seed``."""
    for name, v in (("train_size", train_size), ("eval_size", eval_size), ("max_number", max_number),
                    ("min_steps", min_steps)):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if max_steps < min_steps:
        raise ValueError(f"max_steps: must be >= min_steps ({min_steps}), got {max_steps}")
    rng = random.Random(seed)
    eval_set, eval_sigs = [], set()
    while len(eval_set) < eval_size:
        sig, p = make_arithmetic_problem(rng, max_number=max_number, min_steps=min_steps, max_steps=max_steps)
        if sig not in eval_sigs:
            eval_sigs.add(sig)
            eval_set.append(p)
    train, tries = [], 0
    while len(train) < train_size:
        tries += 1
        if tries > 50 * train_size:
            raise ValueError("train_size: too large for the signature space; raise max_number or max_steps")
        sig, p = make_arithmetic_problem(rng, max_number=max_number, min_steps=min_steps, max_steps=max_steps)
        if sig not in eval_sigs:
            train.append(p)
    return Task("arithmetic", train, eval_set)


# ------------------------------------------------------------------ largest
LARGEST_SYSTEM = "Answer in one short sentence."


def _triple(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.sample(range(10, 100), 3))


def _largest_qa(t: tuple[int, int, int]) -> tuple[str, str]:
    a, b, c = t
    return f"Which number is the largest: {a}, {b} or {c}?", f"The largest number is {max(t)}."


def largest_task(*, seed: int, train_size: int, eval_size: int, shots: int = 3) -> Task:
    """Train / held-out "largest of three" problems, disjoint by the unordered triple.

    Each problem carries ``shots`` worked examples drawn from the training side (a
    per-problem seeded draw, so prompts vary in their examples too)."""
    for name, v in (("train_size", train_size), ("eval_size", eval_size)):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if shots < 0:
        raise ValueError(f"shots: must be >= 0, got {shots}")
    rng = random.Random(seed)
    eval_t, eval_keys = [], set()
    while len(eval_t) < eval_size:
        t = _triple(rng)
        if frozenset(t) not in eval_keys:
            eval_keys.add(frozenset(t))
            eval_t.append(t)

    def train_triple(r):
        while True:
            t = _triple(r)
            if frozenset(t) not in eval_keys:
                return t

    def problem(t, r):
        q, a = _largest_qa(t)
        ex = tuple(_largest_qa(train_triple(r)) for _ in range(shots))
        return Problem(prompt=q, answer=str(max(t)), solution=" " + a, system=LARGEST_SYSTEM, shots=ex)

    ev = [problem(t, rng) for t in eval_t]
    train = [problem(train_triple(rng), rng) for _ in range(train_size)]
    return Task("largest", train, ev)


# ------------------------------------------------------------------ jsonl
def read_jsonl(path: str | Path, key: str = "train_file") -> list[Problem]:
    """Problems of a jsonl file; every error names ``key`` (``train_file`` / ``eval_file``),
    the file and the line. ``prompt`` is a string, ``answer`` a string or a number,
    ``solution`` (optional) a string or null."""
    out = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{key}: cannot read {str(path)!r} ({e.strerror or e})") from None
    with f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise ValueError(f"{key}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{key}: {path}:{i} is not JSON ({e})") from None
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise ValueError(f"{key}: {path}:{i} needs the keys 'prompt' and 'answer'")
        prompt, answer, sol, system = row["prompt"], row["answer"], row.get("solution"), row.get("system")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{key}: {path}:{i}: 'prompt' must be a non-empty string, got {prompt!r}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "":
            raise ValueError(f"{key}: {path}:{i}: 'answer' must be a string or a number, got {answer!r}")
        if sol is not None and not isinstance(sol, str):
            raise ValueError(f"{key}: {path}:{i}: 'solution' must be a string or null, got {sol!r}")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"{key}: {path}:{i}: 'system' must be a string or null, got {system!r}")
        out.append(Problem(prompt, str(answer), sol, system=system or None))
    if not out:
        raise ValueError(f"{key}: {path} holds no problems")
    return out


def jsonl_task(train_file: str, eval_file: str | None, *, seed: int, eval_size: int) -> Task:
    """User problems; without ``eval_file`` the last ``eval_size`` of a seeded shuffle are held out."""
    train = read_jsonl(train_file, "train_file")
    if eval_file:
        return Task("jsonl", train, read_jsonl(eval_file, "eval_file"))
    if len(train) <= eval_size:
        raise ValueError(f"eval_size: {eval_size} leaves no training problems out of {len(train)}")
    rng = random.Random(seed)
    idx = list(range(len(train)))
    rng.shuffle(idx)
    return Task("jsonl", [train[i] for i in idx[:-eval_size]], [train[i] for i in idx[-eval_size:]])


def build_task(cfg) -> Task:
    """The task named by ``cfg.task`` with its splits (see :class:`pdmask.train.config.TrainConfig`)."""
    check_choice("task", cfg.task, TASKS)
    if cfg.task == "arithmetic":
        return arithmetic_task(seed=cfg.task_seed, train_size=cfg.train_size, eval_size=cfg.eval_size,
                               max_number=cfg.max_number, min_steps=cfg.min_steps, max_steps=cfg.max_steps)
    if cfg.task == "largest":
        return largest_task(seed=cfg.task_seed, train_size=cfg.train_size, eval_size=cfg.eval_size, shots=cfg.shots)
    if not cfg.train_file:  # jsonl
        raise ValueError("train_file: required when task=jsonl")
    return jsonl_task(cfg.train_file, cfg.eval_file, seed=cfg.task_seed, eval_size=cfg.eval_size)


#: the task names build_task knows
TASKS = ("arithmetic", "largest", "jsonl")


def eval_rewards(cfg) -> dict[str, Callable[[str, str], float]]:
    """Scorers of held-out greedy generations: ``accuracy`` (the training reward) and, for
    the arithmetic task, the format-blind ``last_number_accuracy``."""
    out = {"accuracy": get_reward(cfg.reward)}
    if cfg.task == "arithmetic":
        out["last_number_accuracy"] = last_number_reward
    return out
