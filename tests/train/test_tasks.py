"""Tasks, rewards, advantages and the tokenizer."""

import json
import re

import pytest
import torch

from pdmask.train.rollout import group_advantages
from pdmask.train.sft import alt_format
from pdmask.train.tasks import (
    answer_format_reward, answer_reward, arithmetic_task, extract_answer, get_reward, jsonl_task,
)


@pytest.mark.parametrize("text, answer, want", [
    (" 3 + 4 = 7. answer: 7", "7", 1.0),
    (" answer: 7", "7.0", 1.0),
    (" answer: 6", "7", 0.0),
    (" answer: 6 ... answer: 7", "7", 1.0),  # the last one counts
    (" 3 + 4 = 7. so there are 7", "7", 0.0),  # no answer line
    ("answer:-2", "-2", 1.0),
    ("", "1", 0.0),
])
def test_answer_reward(text, answer, want):
    assert answer_reward(text, answer) == want


def test_answer_format_reward_partial_credit():
    assert answer_format_reward(" answer: 7", "7") == 1.0
    assert answer_format_reward(" answer: 8", "7") == 0.2
    assert answer_format_reward(" so there are 7", "7") == 0.0


def test_get_reward_by_name_and_import_path():
    assert get_reward("answer") is answer_reward
    assert get_reward("pdmask.train.tasks:answer_format_reward") is answer_format_reward
    with pytest.raises(ValueError, match="^reward:"):
        get_reward("nope")
    with pytest.raises(ValueError, match="^reward:"):
        get_reward("pdmask.train.tasks:missing")


def _check_solution(p):
    """Re-do the arithmetic of a worked solution and the story's numbers."""
    steps = re.findall(r"(\d+) ([+-]) (\d+) = (\d+)\.", p.solution)
    assert steps
    cur = int(re.search(r"has (\d+) ", p.prompt).group(1))
    for a, op, b, c in steps:
        assert int(a) == cur
        cur = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert cur == int(c) and cur >= 0
    assert extract_answer(p.solution) == str(cur) == p.answer


def test_arithmetic_task_is_seeded_correct_and_held_out():
    t1 = arithmetic_task(seed=3, train_size=400, eval_size=50, max_number=10)
    t2 = arithmetic_task(seed=3, train_size=400, eval_size=50, max_number=10)
    t3 = arithmetic_task(seed=4, train_size=400, eval_size=50, max_number=10)
    assert t1.train == t2.train and t1.eval == t2.eval and t1.train != t3.train
    for p in t1.train[:100] + t1.eval:
        _check_solution(p)
        assert p.prompt.startswith("Q: ") and p.prompt.endswith("\nA:")
    # held out by arithmetic signature: no eval calculation appears in training
    sig = lambda p: re.findall(r"\d+ [+-] \d+ = \d+", p.solution)  # noqa: E731
    train_sigs = {tuple(sig(p)) for p in t1.train}
    assert not any(tuple(sig(p)) in train_sigs for p in t1.eval)
    assert answer_reward(t1.train[0].solution, t1.train[0].answer) == 1.0
    assert answer_reward(alt_format(t1.train[0].solution), t1.train[0].answer) == 0.0


def test_jsonl_task(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)) + "\n")
    t = jsonl_task(str(f), None, seed=0, eval_size=3)
    assert len(t.train) == 7 and len(t.eval) == 3
    assert {p.prompt for p in t.train} | {p.prompt for p in t.eval} == {f"q{i}" for i in range(10)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="^train_file:.*answer"):
        jsonl_task(str(bad), None, seed=0, eval_size=1)


def test_group_advantages_match_naive_loop():
    torch.manual_seed(0)
    r = torch.rand(24)
    r[8:16] = 1.0  # a group with equal rewards gets zero advantage
    a = group_advantages(r, 8)
    for g in range(3):
        x = r[g * 8:(g + 1) * 8]
        ref = (x - x.mean()) / (x.std(unbiased=False) + 1e-6)
        torch.testing.assert_close(a[g * 8:(g + 1) * 8], ref)
    assert (a[8:16] == 0).all()
    b = group_advantages(r, 8, std_norm=False)
    torch.testing.assert_close(b[:8], r[:8] - r[:8].mean())
    with pytest.raises(ValueError, match="^rewards:"):
        group_advantages(r, 5)


def test_tokenizer_vocabulary_is_full_size():
    from pdmask.train.tokenizer import train_bpe_tokenizer

    t = arithmetic_task(seed=1, train_size=3000, eval_size=10, max_number=10)
    tok = train_bpe_tokenizer([p.prompt + p.solution for p in t.train], 1024)
    assert len(tok) == 1024 and tok.pad_token_id == 0 and tok.eos_token_id == 1
    text = t.train[0].prompt + t.train[0].solution
    assert tok.decode(tok(text).input_ids) == text
    with pytest.raises(ValueError, match="^vocab_size:"):
        train_bpe_tokenizer(["a b"] * 10, 5000)
