"""The trainer's configuration: one dataclass, every field with a help text.

``load_config(path, overrides)`` reads a YAML preset and applies ``key=value``
overrides (values parsed as YAML: ``lr=3e-4``, ``full_logits=true``, ``delta_high=null``).
Unknown keys raise ``ValueError`` naming the key and listing the valid names; values are
type-checked against the field's type and :meth:`TrainConfig.validate` checks ranges and
choices. ``pdmask train --help-config`` prints the table of fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class TrainConfig:
    # ---------------------------------------------------------------- run
    name: str = _f("", "run name; the run directory is out_dir/name (default: <mode>-s<seed>)")
    out_dir: str = _f("runs", "parent directory of run directories")
    seed: int = _f(0, "RL seed: rollout sampling and mini-batch order (the SFT base uses sft_seed)")
    threads: int = _f(1, "torch CPU threads (1 is fastest for the tiny default model on a shared machine)")
    device: str = _f("cpu", "torch device of the trainer and the hf engine (cpu, cuda, cuda:1, ...)")
    # ---------------------------------------------------------------- model
    model_path: str = _f("", "local Hugging Face causal-LM directory (with its tokenizer), or a named source "
                             "(smollm2-135m: a pip package's GGUF, converted once into the cache); empty: build "
                             "from the fields below")
    arch: str = _f("llama", "architecture of the built-in model: llama or qwen3")
    vocab_size: int = _f(1024, "BPE vocabulary size of the built-in tokenizer (>= 1024 keeps top-20 truncation real)")
    hidden_size: int = _f(128, "built-in model width")
    num_layers: int = _f(4, "built-in model depth")
    num_heads: int = _f(4, "attention heads (key/value heads equal)")
    intermediate_size: int = _f(384, "MLP inner width")
    max_positions: int = _f(160, "maximum sequence length (prompt + response)")
    tie_embeddings: bool = _f(True, "built-in model: the output layer (LM head) shares the input embedding's "
                                    "weights; false: an untied head (with model_path the checkpoint decides)")
    # ---------------------------------------------------------------- task
    task: str = _f("arithmetic", "arithmetic (built-in, generated from task_seed), largest (largest of three numbers, "
                                 "for a pretrained chat model; needs use_chat_template) or jsonl (train_file/eval_file)")
    task_seed: int = _f(1234, "seed of the generated problems and of the jsonl eval split")
    train_size: int = _f(20000, "number of generated training problems")
    eval_size: int = _f(200, "number of held-out problems (greedy accuracy is measured on them)")
    max_number: int = _f(10, "arithmetic: operands are drawn from 1..max_number (values stay <= 2*max_number)")
    min_steps: int = _f(2, "arithmetic: fewest operations per problem")
    max_steps: int = _f(3, "arithmetic: most operations per problem")
    shots: int = _f(3, "largest: worked examples (user/assistant turns) before each question")
    train_file: str = _f("", "jsonl: training problems, one {prompt, answer[, solution]} per line")
    eval_file: str = _f("", "jsonl: held-out problems (default: eval_size split off train_file)")
    reward: str = _f("answer", "reward: answer (last 'answer: N' is right), answer+steps (and every 'a +/- b = c' is true), answer+format, last-number, or module:function")
    use_chat_template: bool = _f(False, "wrap prompts with the tokenizer's chat template (for instruct checkpoints)")
    # ---------------------------------------------------------------- SFT warm start
    sft_steps: int = _f(250, "SFT steps on generated solutions before RL (0: start RL from the model as is)")
    sft_batch_size: int = _f(64, "SFT sequences per step")
    sft_lr: float = _f(3e-3, "SFT peak learning rate (linear warmup 5%, cosine decay)")
    sft_seed: int = _f(0, "seed of the SFT base (model init and data order); shared by all RL seeds")
    sft_alt_format: float = _f(0.0, "fraction of SFT solutions that end in 'so there are N' instead of 'answer: N' "
                                    "(the answer reward rejects it): a habit of the SFT base that RL must unlearn")
    cache_dir: str = _f("", "SFT checkpoint cache (default: $PDMASK_CACHE or ~/.cache/pdmask)")
    # ---------------------------------------------------------------- RL
    steps: int = _f(30, "RL steps (one rollout batch each)")
    prompts_per_step: int = _f(16, "distinct prompts per rollout batch")
    group_size: int = _f(8, "samples per prompt (GRPO group)")
    minibatches: int = _f(4, "optimizer updates per rollout batch (>1 makes later updates off-policy)")
    epochs: int = _f(1, "passes over the rollout batch")
    lr: float = _f(3e-5, "AdamW learning rate of the RL stage (constant; 1e-4 already destabilises the default model)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "max global grad norm (0: no clipping)")
    adv_std_norm: bool = _f(True, "divide group advantages by the group std (GRPO); false: mean-centred only (Dr. GRPO)")
    max_new_tokens: int = _f(28, "response length cap")
    temperature: float = _f(1.0, "sampling temperature of the engine; the loss uses pi = softmax(logits / temperature)")
    # ---------------------------------------------------------------- trainable parameters (docs/trainer.md)
    train_blocks: int = _f(0, "train only the last N decoder blocks and the final norm (0: every parameter); the "
                              "embeddings, lower blocks and LM head (tied or not) are frozen and not in the optimizer")
    lora_rank: int = _f(0, "LoRA rank r: peft adapters on lora_targets in every block (in the last train_blocks "
                           "blocks when that is set); only the adapters train (0: off; needs the 'lora' extra)")
    lora_alpha: float = _f(16.0, "LoRA scale s = lora_alpha / lora_rank (adapter dropout is 0)")
    lora_targets: str = _f("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                           "comma-separated names of the block linears LoRA adapts (default: attention and MLP)")
    loss_from: str = _f("logits", "logits: the loss reads the trainer's (B, T, V) logits; hidden: it reads the "
                                  "final hidden states and the LM-head weight, and no (B, T, V) tensor enters the graph "
                                  "(pdmask.policy_loss_from_hidden; not with full_logits or the pdm-batch-* modes)")
    # ---------------------------------------------------------------- loss / mask
    mode: str = _f("pdm-topk-kl", "mask mode from pdmask.MODES (grpo, dppo-topk-kl, pdm-topk-kl, drpo, spo, "
                                  "pdm-smooth-topk-kl, ...)")
    estimator: str = _f("exact", "top-K tail estimator of Ddot: exact, aggregated, uniform, truncated")
    support: str = _f("topk+sampled", "support of the top-K divergences: topk+sampled (the rollout's top-K plus the "
                                      "sampled token) or topk (the top-K alone, the DPPO reference code); "
                                      "not with the pdm-batch-* modes")
    delta_low: typing.Optional[float] = _f(None, "divergence threshold for A < 0, the smooth modes' scale delta "
                                                 "(null: the mode's default)")
    delta_high: typing.Optional[float] = _f(None, "divergence threshold for A > 0, the smooth modes' scale delta "
                                                  "(null: the mode's default)")
    eps_low: float = _f(0.2, "grpo ratio clip below 1")
    eps_high: float = _f(0.28, "grpo ratio clip above 1 (clip-higher)")
    is_cap: typing.Optional[float] = _f(None, "IS-weight cap C in min(r, C) and upper bound of is_mask (null: 5; "
                                              ".inf disables); grpo's dual-clip constant unless dual_clip is set")
    dual_clip: typing.Optional[float] = _f(None, "grpo only: dual-clip constant C, the loss of an A < 0 token is at "
                                                 "most -A C (verl clip_ratio_c; null: is_cap; .inf disables)")
    loss_agg: str = _f("token-mean", "loss aggregation (verl's agg_loss modes): token-mean, token-sum, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm")
    # ---------------------------------------------------------------- off-policy corrections (docs/corrections.md)
    is_level: typing.Optional[str] = _f("token", "IS weight: token (r), sequence (prod r) or null (none); verl rollout_is")
    is_floor: typing.Optional[float] = _f(None, "lower bound of the IS weight (null: none); TRL vllm_importance_sampling_clip_min")
    is_mask: bool = _f(False, "mask tokens/sequences whose IS weight is outside [is_floor, is_cap] (MIS, IcePop) instead of truncating (TIS)")
    is_batch_normalize: bool = _f(False, "divide the IS weights by their batch mean; verl rollout_is_batch_normalize")
    rejection: str = _f("", "rejection rules, comma-separated (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/3; empty: none); verl rollout_rs")
    rejection_threshold: str = _f("", "their thresholds in verl's syntax: one value, or one per rule, 'lo_hi' for k1 rules; verl rollout_rs_threshold")
    off_policy_mask_threshold: typing.Optional[float] = _f(None, "mask sequences with A < 0 and mean log(mu/pi) above this (DeepSeek-V3.2; TRL's name; null: off)")
    batch_params: str = _f("all", "pdm-batch-* modes only: parameters of the batch direction, all or N (the last N "
                                  "blocks + final norm + LM head: the cheaper variant)")
    batch_method: str = _f("auto", "pdm-batch-* modes only: how the batch direction's J v is computed: auto "
                                   "(forward mode, double backward if the model lacks it), jvp, double-backward")
    # ---------------------------------------------------------------- engine
    engine: str = _f("hf", "rollout backend: hf (transformers); vllm when that backend is installed")
    engine_share_prefill: bool = _f(False, "hf engine: prefill each distinct prompt once and copy its KV cache to "
                                           "its group (1/group_size of the prefill; equal up to GEMM rounding, so "
                                           "off by default and earlier figures reproduce bit for bit)")
    engine_precision: str = _f("bf16", "engine weights/compute: fp32, bf16, fp16, fp8 (fp8 weights, fp32 compute), fp8-bf16")
    top_k: int = _f(20, "K of the engine's reported top-K log-probs")
    sync_every: int = _f(1, "copy trainer weights to the engine every N steps (N > 1: policy lag of up to N-1 steps)")
    full_logits: bool = _f(False, "also fetch the engine's full logits (oracle mismatch metrics; needed by pdm-full-* modes)")
    sampling_top_k: int = _f(0, "engine samples from its k most likely tokens (0: off); the loss renormalises pi over the same kept set")
    sampling_top_p: float = _f(1.0, "engine samples from the smallest set holding top_p of the mass (1: off; vLLM's order: min_p, top_k, top_p)")
    sampling_min_p: float = _f(0.0, "engine drops tokens below min_p x the top probability (0: off)")
    # ---------------------------------------------------------------- logging / checkpoints
    eval_every: int = _f(5, "held-out greedy accuracy every N steps (and at step 0 and the end)")
    checkpoint_every: int = _f(10, "save a resumable checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk (older ones are deleted); with 2 or more a corrupt newest "
                                  "checkpoint falls back to the previous one on resume")
    tensorboard: bool = _f(True, "write TensorBoard event files next to metrics.jsonl")
    progress: bool = _f(True, "show a progress bar")

    # ------------------------------------------------------------------
    @property
    def run_name(self) -> str:
        return self.name or f"{self.mode}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.run_name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "TrainConfig":
        """Range and choice checks; raises ValueError naming the field."""
        from .. import MODES
        from ..directions import ESTIMATORS
        from ..keys import SUPPORTS
        from .._validate import LOSS_AGGS
        from ..engine.precision import PRECISIONS
        from ..engine.registry import engine_names

        from .tasks import TASKS

        choices = {"arch": ("llama", "qwen3"), "task": TASKS, "mode": tuple(MODES),
                   "estimator": tuple(ESTIMATORS), "support": SUPPORTS, "loss_agg": LOSS_AGGS, "engine_precision": PRECISIONS,
                   "engine": tuple(engine_names())}
        for k, valid in choices.items():
            if getattr(self, k) not in valid:
                raise ValueError(f"{k}: unknown value {getattr(self, k)!r}; valid values are: {', '.join(valid)}")
        from .forwards import FORWARDS, forward_for

        forward_for(self.mode)  # a mode needing an input that no registered trainer forward computes
        for fwd in FORWARDS.values():  # the settings each registered forward reads (batch_method)
            if fwd.check is not None:
                fwd.check(self)
        positive = ["threads", "vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                    "max_positions", "train_size", "eval_size", "max_number", "min_steps", "max_steps",
                    "sft_batch_size", "steps", "prompts_per_step", "group_size", "minibatches", "epochs",
                    "max_new_tokens", "top_k", "sync_every", "eval_every", "keep_checkpoints"]
        for k in positive:
            if getattr(self, k) < 1:
                raise ValueError(f"{k}: must be >= 1, got {getattr(self, k)}")
        for k in ("sft_steps", "checkpoint_every"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k}: must be >= 0, got {getattr(self, k)}")
        for k in ("lr", "sft_lr", "temperature", "eps_low", "eps_high", "is_cap", "dual_clip"):
            v = getattr(self, k)
            if v is None and k in ("is_cap", "dual_clip"):
                continue
            if not (v > 0) or (math.isinf(v) and k not in ("is_cap", "dual_clip")):
                raise ValueError(f"{k}: must be a positive number, got {v}")
        if not 0.0 <= self.sft_alt_format <= 1.0:
            raise ValueError(f"sft_alt_format: must lie in [0, 1], got {self.sft_alt_format}")
        for k in ("weight_decay", "grad_clip"):
            v = getattr(self, k)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{k}: must be a finite number >= 0{' (0: no clipping)' if k == 'grad_clip' else ''}, "
                                 f"got {v}")
        if self.group_size < 2:
            raise ValueError(f"group_size: must be >= 2 (GRPO advantages are relative to the group: with one sample "
                             f"per prompt every advantage is 0 and nothing is learned), got {self.group_size}")
        if not self.name.strip() and self.name:
            raise ValueError(f"name: must not be blank, got {self.name!r}")
        if self.name and (self.name in (".", "..") or "/" in self.name or "\\" in self.name):
            raise ValueError(f"name: must be a plain directory name (no '/', not '.' or '..'), got {self.name!r}")
        if not self.out_dir.strip():
            raise ValueError("out_dir: must not be empty")
        if not self.model_path:  # the built-in model and its BPE tokenizer
            if self.use_chat_template:
                raise ValueError("use_chat_template: the built-in tokenizer has no chat template; set model_path to "
                                 "a checkpoint whose tokenizer has one, or use_chat_template=false")
            if self.vocab_size < 300:
                raise ValueError(f"vocab_size: must be >= 300 (256 bytes + specials + merges), got {self.vocab_size}")
            if self.top_k > self.vocab_size:
                raise ValueError(f"top_k: must be <= vocab_size ({self.vocab_size}), got {self.top_k}")
            if self.max_positions <= self.max_new_tokens:
                raise ValueError(f"max_positions: must exceed max_new_tokens ({self.max_new_tokens}) to leave room for "
                                 f"a prompt, got {self.max_positions}")
        for k in ("delta_low", "delta_high"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise ValueError(f"{k}: must be a positive number or null, got {v}")
        if self.max_steps < self.min_steps:
            raise ValueError(f"max_steps: must be >= min_steps ({self.min_steps}), got {self.max_steps}")
        n = self.prompts_per_step * self.group_size
        if n % self.minibatches:
            raise ValueError(f"minibatches: must divide prompts_per_step * group_size = {n}, got {self.minibatches}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: must divide hidden_size = {self.hidden_size}, got {self.num_heads}")
        if self.batch_params != "all" and not (self.batch_params.isdigit() and int(self.batch_params) >= 1):
            raise ValueError(f"batch_params: expected all or a number of last blocks >= 1, got {self.batch_params!r}")
        if self.batch_params != "all" and not self.model_path and int(self.batch_params) > self.num_layers:
            raise ValueError(f"batch_params: the model has num_layers={self.num_layers} blocks, got {self.batch_params}")
        if self.mode.startswith("pdm-full") and not self.full_logits:
            raise ValueError(f"full_logits: mode {self.mode!r} needs the engine's full logits; set full_logits=true")
        if self.model_path and not self.tie_embeddings:
            raise ValueError("tie_embeddings: applies to the built-in model only; with model_path set the "
                             "checkpoint's own config.json (tie_word_embeddings) decides")
        if self.task == "jsonl" and not self.train_file:
            raise ValueError("train_file: required when task=jsonl")
        if self.task == "largest" and not self.use_chat_template:
            raise ValueError("use_chat_template: task=largest asks its worked examples as chat turns; set "
                             "use_chat_template=true (and a model_path whose tokenizer has a chat template)")
        if self.shots < 0:
            raise ValueError(f"shots: must be >= 0, got {self.shots}")
        _validate_corrections(self)
        _validate_trainable(self)
        return self


def _validate_trainable(cfg: TrainConfig) -> None:
    """The trainable-parameter variant (train_blocks, lora_*) and loss_from: ranges, and
    the combinations the trainer cannot serve."""
    from .. import MODES
    from .trainable import LORA_TARGETS

    for k in ("train_blocks", "lora_rank"):
        if getattr(cfg, k) < 0:
            raise ValueError(f"{k}: must be >= 0 (0: off), got {getattr(cfg, k)}")
    if not (cfg.lora_alpha > 0 and math.isfinite(cfg.lora_alpha)):
        raise ValueError(f"lora_alpha: must be a finite number > 0, got {cfg.lora_alpha}")
    names = [t.strip() for t in cfg.lora_targets.split(",")]
    if not all(t.isidentifier() for t in names):
        raise ValueError(f"lora_targets: expected comma-separated module names (e.g. {','.join(LORA_TARGETS[:2])}), "
                         f"got {cfg.lora_targets!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"lora_targets: names a module twice: {cfg.lora_targets!r}")
    if not cfg.lora_rank:  # no option silently ignored: the LoRA settings need LoRA on
        for k in ("lora_alpha", "lora_targets"):
            if getattr(cfg, k) != FIELDS[k].default:
                raise ValueError(f"{k}: applies with lora_rank >= 1 only (LoRA is off); set lora_rank or remove {k}")
    if not cfg.model_path and cfg.train_blocks > cfg.num_layers:
        raise ValueError(f"train_blocks: the model has num_layers={cfg.num_layers} blocks, got {cfg.train_blocks}")
    if cfg.loss_from not in ("logits", "hidden"):
        raise ValueError(f"loss_from: unknown value {cfg.loss_from!r}; valid values are: logits, hidden")
    needs = MODES[cfg.mode].needs if cfg.mode in MODES else ()
    if cfg.loss_from == "hidden":
        if "batch" in needs:
            raise ValueError(f"loss_from: mode {cfg.mode!r} computes its batch direction on the logits of its own "
                             "forward; use loss_from=logits")
        if cfg.full_logits:
            raise ValueError("loss_from: hidden takes no rollout logits, and full_logits=true is for them (the "
                             f"*-full-* modes, the full-vocabulary mismatch metrics); use loss_from=logits "
                             f"(mode {cfg.mode!r}) or full_logits=false")


def effective_is_cap(cfg: TrainConfig) -> float:
    """The IS cap the config means: ``is_cap``, or pdmask's default when it is null (null,
    not 5, is the field's default so that a cap the loss would ignore can be refused)."""
    from ..corrections import DEFAULT_IS_CAP

    return DEFAULT_IS_CAP if cfg.is_cap is None else cfg.is_cap


def corrections(cfg: TrainConfig):
    """The config's :class:`pdmask.Corrections` (the field names are its field names; an
    empty ``rejection`` / ``rejection_threshold`` string is None)."""
    from ..corrections import Corrections

    return Corrections.from_fields(cfg, rejection=cfg.rejection or None,
                                   rejection_threshold=cfg.rejection_threshold or None)


def sampling(cfg: TrainConfig):
    """The engine's :class:`pdmask.Sampling` (``temperature`` and ``sampling_*``); an error
    names the config field."""
    from ..ops import Sampling

    try:
        return Sampling(temperature=cfg.temperature, top_k=cfg.sampling_top_k, top_p=cfg.sampling_top_p,
                        min_p=cfg.sampling_min_p)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("temperature") else f"sampling_{msg}") from None


def loss_spec(cfg: TrainConfig, *, validate: bool = False):
    """The trainer's :class:`pdmask.PolicyLoss`: the one spec built from the config (every
    setting checked there, once; errors name the field)."""
    from ..loss import Aggregation, PolicyLoss
    from ..masks import Thresholds

    return PolicyLoss(mode=cfg.mode, estimator=cfg.estimator, support=cfg.support,
                      thresholds=Thresholds(cfg.delta_low, cfg.delta_high, cfg.eps_low, cfg.eps_high, cfg.dual_clip),
                      corrections=corrections(cfg), sampling=sampling(cfg),
                      aggregation=Aggregation(cfg.loss_agg), validate=validate)


def _validate_corrections(cfg: TrainConfig) -> None:
    """The loss spec's own checks (:func:`loss_spec`), and what truncated sampling excludes."""
    from .. import MODES

    if cfg.mode not in MODES:
        return
    spec = loss_spec(cfg)
    if not spec.sampling.truncated:
        return
    on = next(k for k in ("sampling_top_k", "sampling_top_p", "sampling_min_p")
              if getattr(cfg, k) not in (0, -1, 1.0, 0.0))
    if cfg.full_logits:
        raise ValueError(f"{on}: truncated sampling cannot be combined with full_logits=true "
                         "(the full-vocabulary terms are those of the untruncated mu)")
    if "batch" in MODES[cfg.mode].needs:
        raise ValueError(f"{on}: mode {cfg.mode!r} computes its batch direction on the untruncated pi; "
                         "truncated sampling is not available with the pdm-batch-* modes")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def field_help() -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of every field, for the CLI."""
    hints = typing.get_type_hints(TrainConfig)
    return [(f.name, _type_name(hints[f.name]), repr(f.default), f.metadata["help"]) for f in dataclasses.fields(TrainConfig)]


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if args:
        return "|".join(a.__name__ if a is not type(None) else "null" for a in args)
    return tp.__name__


def _unknown(key: str, where: str) -> ValueError:
    close = difflib.get_close_matches(key, FIELDS, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ValueError(f"{key}: unknown config key in {where}{hint}; valid names are: {', '.join(FIELDS)}")


def _coerce(key: str, value: Any) -> Any:
    tp = typing.get_type_hints(TrainConfig)[key]
    args = typing.get_args(tp)
    if args:  # Optional[X]
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
        return math.inf
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp is str and value is None:
        return ""
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value parsed as YAML (``3e-4`` -> float, ``true`` -> bool)."""
    import yaml

    if "=" not in text:
        raise ValueError(f"override: expected key=value, got {text!r}")
    key, _, raw = text.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _yaml_number(value):
    """PyYAML reads ``3e-4`` (no dot) as a string; accept it as a float."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            return value
    return value


def make_config(values: dict[str, Any], where: str = "config") -> TrainConfig:
    for k in values:
        if k not in FIELDS:
            raise _unknown(k, where)
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for k, v in values.items():
        if float in (hints[k], *typing.get_args(hints[k])):
            v = _yaml_number(v)
        out[k] = _coerce(k, v)
    return TrainConfig(**out).validate()


def _yaml_where(e) -> str:
    """`` at line L, column C (problem)`` of a PyYAML error, on one line."""
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at} ({getattr(e, 'problem', None) or str(e).splitlines()[0]})"


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Read a YAML preset (``None``: defaults) and apply overrides; validated."""
    import yaml

    values: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"config: file {str(path)!r} not found")
        if p.is_dir():
            raise ValueError(f"config: {str(path)!r} is a directory, not a YAML file")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"config: cannot read {str(path)!r} ({getattr(e, 'strerror', None) or e})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config: {str(path)!r} is not valid YAML{_yaml_where(e)}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config: {path} must hold a mapping of key: value")
        if not all(isinstance(k, str) for k in data):
            bad = next(k for k in data if not isinstance(k, str))
            raise ValueError(f"config: {path}: key {bad!r} is not a name")
        for k in data:
            if k not in FIELDS:
                raise _unknown(k, str(path))
        values.update(data)
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = [parse_override(o) for o in (overrides or [])]
    for k, v in items:
        if k not in FIELDS:
            raise _unknown(k, "overrides")
        values[k] = v
    return make_config(values, where=str(path) if path else "config")


def replace(cfg: TrainConfig, **changes) -> TrainConfig:
    """A validated copy with ``changes`` (unknown keys raise like overrides)."""
    vals = cfg.to_dict()
    for k, v in changes.items():
        if k not in FIELDS:
            raise _unknown(k, "overrides")
        vals[k] = v
    return make_config(vals)


# ------------------------------------------------------------------ stored runs
#: config keys that do not change a run's result (ignored when a stored run is compared with
#: a config: the ladder's cells, prefix cells); keep_checkpoints only decides how many
#: checkpoints stay on disk (its default went 1 -> 2 after the first ladder cells were run)
NEUTRAL_KEYS = ("out_dir", "progress", "cache_dir", "tensorboard", "name", "keep_checkpoints")


def stored_config(run_dir: Path) -> dict | None:
    """The ``config.yaml`` a run directory holds (None when it holds none).

    Raises ValueError naming the file when it cannot be read as a mapping of key: value
    (not UTF-8, not valid YAML, a list): a run's own record, damaged, is never a traceback."""
    import yaml

    p = Path(run_dir) / "config.yaml"
    if not p.exists():
        return None
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML{_yaml_where(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: holds a {type(data).__name__}, not a mapping of key: value")
    return data


def _null_means(key: str, value):
    """A field whose null default stands for a value compares by that value: ``is_cap``
    null is 5 (runs made before the null default stored ``is_cap: 5.0``)."""
    return effective_is_cap(TrainConfig()) if key == "is_cap" and value is None else value


def config_diff(stored: dict, cfg: TrainConfig) -> dict:
    """Keys whose stored value differs from ``cfg`` (results-neutral keys ignored). A key
    the stored config lacks counts as equal when ``cfg`` holds the field's default: a
    field added to :class:`TrainConfig` after the run was made, at the value that keeps
    the old behaviour."""
    want = cfg.to_dict()
    keys = (set(stored) | set(want)) - set(NEUTRAL_KEYS)
    out = {}
    for k in sorted(keys):
        if k not in stored and k in FIELDS and want.get(k) == FIELDS[k].default:
            continue
        if _null_means(k, stored.get(k)) != _null_means(k, want.get(k)):
            out[k] = (stored.get(k), want.get(k))
    return out
