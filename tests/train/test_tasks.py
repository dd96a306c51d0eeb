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


def test_steps_reward_rejects_compensating_errors():
    from pdmask.train.tasks import steps_reward

    assert steps_reward(" 5 + 3 = 8. 8 - 2 = 6. answer: 6", "6") == 1.0
    assert steps_reward(" 5 + 3 = 9. 9 - 3 = 6. answer: 6", "6") == 0.0  # right answer, wrong steps
    assert steps_reward(" 5 + 3 = 8. 8 - 2 = 6. answer: 7", "7") == 0.0
    assert steps_reward(" 5 + 3 = 8. 8 - 2 = 6. so there are 6", "6") == 0.0
    assert steps_reward(" answer: 6", "6") == 1.0  # no equations to check


def test_answer_format_reward_partial_credit():
    assert answer_format_reward(" answer: 7", "7") == 1.0
    assert answer_format_reward(" answer: 8", "7") == 0.2
    assert answer_format_reward(" so there are 7", "7") == 0.0


def test_get_reward_by_name_and_import_path():
    assert get_reward("answer") is answer_reward
    assert get_reward("answer+steps").__name__ == "steps_reward"
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


# ------------------------------------------------------------------ largest / first-number
@pytest.mark.parametrize("text,answer,want", [
    ("The largest number is 83.", "83", 1.0),
    ("83", "83", 1.0),
    ("The largest is 83, not 47.", "83", 1.0),      # the first number decides
    ("47 is smaller than 83.", "83", 0.0),          # listing candidates earns nothing
    ("The largest number is 83.0!", "83", 1.0),     # numerically equal
    ("The largest number is -83.", "83", 0.0),
    ("The largest number is eighty-three.", "83", 0.0),  # no number written
    ("", "83", 0.0),
])
def test_first_number_reward(text, answer, want):
    from pdmask.train.tasks import first_number_reward, get_reward

    assert first_number_reward(text, answer) == want
    assert get_reward("first-number") is first_number_reward


def test_largest_task_is_seeded_correct_held_out_and_chat_shaped():
    from pdmask.train.tasks import LARGEST_SYSTEM, largest_task

    t = largest_task(seed=3, train_size=300, eval_size=40, shots=2)
    assert largest_task(seed=3, train_size=300, eval_size=40, shots=2) == t  # seeded
    held = set()
    for p in t.eval:
        nums = [int(x) for x in re.findall(r"\d+", p.prompt)]
        assert len(nums) == 3 and len(set(nums)) == 3 and all(10 <= x <= 99 for x in nums)
        assert p.answer == str(max(nums)) and p.solution == f" The largest number is {max(nums)}."
        held.add(frozenset(nums))
    for p in t.train:  # neither the questions nor their worked examples repeat a held-out triple
        for q in [p.prompt, *(u for u, _ in p.shots)]:
            assert frozenset(int(x) for x in re.findall(r"\d+", q)) not in held
    p = t.train[0]
    m = p.messages()
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m[0]["content"] == LARGEST_SYSTEM and m[-1]["content"] == p.prompt
    u, a = p.shots[0]
    nums = [int(x) for x in re.findall(r"\d+", u)]
    assert a == f"The largest number is {max(nums)}."  # the worked examples are right


def test_largest_needs_the_chat_template():
    from pdmask.train.config import TrainConfig

    with pytest.raises(ValueError, match="^use_chat_template: task=largest"):
        TrainConfig(task="largest", model_path="smollm2-135m", sft_steps=0).validate()


def test_encode_prompts_puts_system_and_shots_before_the_question():
    from pdmask.train.model import encode_prompts
    from pdmask.train.tasks import Problem

    class Tok:  # records the chat it is asked to render
        def apply_chat_template(self, chat, **kw):
            return [len(chat)] + [len(m["content"]) for m in chat]

        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [len(text)]})()

    p = Problem("Which?", "1", system="sys", shots=(("q1", "a1"),))
    assert encode_prompts(Tok(), [p], use_chat_template=True) == [[4, 3, 2, 2, 6]]
    assert encode_prompts(Tok(), ["plain"], use_chat_template=True) == [[1, 5]]
    assert encode_prompts(Tok(), [p, "ab"], use_chat_template=False) == [[6], [2]]


def test_jsonl_system_message(tmp_path):
    from pdmask.train.tasks import read_jsonl

    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "q", "answer": 1, "system": "be brief"}) + "\n"
                 + json.dumps({"prompt": "q2", "answer": 2}) + "\n")
    a, b = read_jsonl(f)
    assert a.messages()[0] == {"role": "system", "content": "be brief"} and b.system is None
    f.write_text(json.dumps({"prompt": "q", "answer": 1, "system": 3}) + "\n")
    with pytest.raises(ValueError, match=r"'system' must be a string or null"):
        read_jsonl(f)


# ------------------------------------------------------------------ no signal
def _rollout(rewards, G, T=3):
    from pdmask.engine.base import RolloutBatch
    from pdmask.train.rollout import RolloutStep

    r = torch.tensor(rewards, dtype=torch.float32)
    B = r.numel()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -1] = False
    from pdmask import Rollout

    ro = Rollout(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), torch.zeros(B, T, 1, dtype=torch.long),
                 torch.zeros(B, T, 1), response_mask=mask)
    batch = RolloutBatch(torch.zeros(B, T + 2, dtype=torch.long), torch.ones(B, T + 2), 2, ro)
    return RolloutStep(batch, r, group_advantages(r, G), G)


def test_zero_advantage_warning_counts():
    from pdmask.train.rollout import zero_advantage_warning

    msg = zero_advantage_warning(_rollout([0, 0, 0, 0, 1, 1], G=2))
    assert msg is not None and "\n" not in msg
    assert "all 3 groups are flat" in msg and "2 of 6 samples rewarded" in msg and "17 response tokens" in msg
    assert zero_advantage_warning(_rollout([0, 1, 0, 0, 1, 1], G=2)) is None
