"""The practitioner's path: ``pdmask audit --model PATH`` on a local Hugging Face causal LM
with one's own prompts (jsonl, through the chat template) and one's own reward, and the
clear refusal when the model cannot serve the preset (no chat template)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the audit needs the 'train' extra (transformers)")

SRC = Path(__file__).resolve().parents[2] / "src"
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _model_dir(path: Path, *, chat_template: bool) -> Path:
    """A tiny random Llama with a BPE tokenizer trained here, saved as a plain HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdmask.train.tokenizer import train_bpe_tokenizer

    texts = [f"<|user|>Is {a} even?</s><|assistant|>{'yes' if a % 2 == 0 else 'no'}</s>" for a in range(200)]
    tok = train_bpe_tokenizer(texts, 300)
    if chat_template:
        tok.chat_template = CHAT
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                      initializer_range=0.3)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _audit(tmp_path, model, extra=()):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Is {a} even?", "answer": "yes" if a % 2 == 0 else "no",
                                           "system": "Answer yes or no."}) + "\n" for a in range(40)))
    (tmp_path / "my_reward.py").write_text(
        "def parity(response, answer):\n    return float(len(response) % 2 == 0)  # any verifiable rule\n")
    args = [sys.executable, "-m", "pdmask.cli", "audit", "--model", str(model), "--out", str(tmp_path / "out"),
            "--seeds", "2", "--delta", "1e-6", "--precision", "fp8-bf16", "--lag", "1", "--set", "lr=1e-2", "--sample-tokens", "2", "--disagreement-tokens", "2",
            "--bootstrap", "50", "--no-progress", "--no-plots", "--instruments", "param",
            "--set", "task=jsonl", "--set", f"train_file={prompts}", "--set", "eval_size=8",
            "--set", "reward=my_reward:parity", "--set", "use_chat_template=true", "--set", "sft_steps=0",
            "--set", "prompts_per_step=2", "--set", "group_size=4", "--set", "max_new_tokens=6",
            "--set", "threads=1", "--set", "top_k=5", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "PDMASK_CACHE": str(tmp_path / "cache")}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_audit_on_my_model_with_my_prompts_and_reward(tmp_path):
    model = _model_dir(tmp_path / "my-model", chat_template=True)
    res = _audit(tmp_path, model)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "audit.json").read_text())
    t = doc["settings"]["run"]["trainer_config"]
    assert t["task"] == "jsonl" and t["use_chat_template"]
    assert t["model_path"] == "my-model" and t["train_file"] == "prompts.jsonl"  # relative to where it ran, not absolute
    seeds = doc["summary"]["per_seed"]
    assert len(seeds) == 2 and sum(s["n_active_tokens"] for s in seeds) > 0
    assert all(0.0 <= s["finished_frac"] <= 1.0 and 0.0 <= s["tail_beyond_topk"] <= 1.0 for s in seeds)
    md = (tmp_path / "out" / "audit.md").read_text()
    assert "## Rollouts" in md and "groups with A != 0" in md


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path):
    model = _model_dir(tmp_path / "plain-model", chat_template=False)
    res = _audit(tmp_path, model)
    assert res.returncode != 0
    err = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert err[-1].startswith("error: use_chat_template: the tokenizer in") and "has no chat template" in err[-1]
    assert not any("Traceback" in x for x in err)
