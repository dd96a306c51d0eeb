"""The trainer's configuration: one dataclass, every field with a help text; the loss is
one :class:`pdmask.PolicyLoss`.

``load_config(path, overrides)`` reads a YAML preset and applies ``key=value`` overrides
(values parsed as YAML: ``lr=3e-4``, ``full_logits=true``, ``loss.thresholds.delta_high=null``).
The loss's settings are the fields of :class:`pdmask.PolicyLoss` and of its specs, under
``loss``: a nested ``loss:`` mapping in YAML, dotted keys on the command line
(``loss.mode=grpo``, ``loss.corrections.is_cap=3``). The short names of the flat config
that came before (``mode``, ``is_cap``, ``temperature``, ``sampling_top_k``,
...: :data:`pdmask.train.loss_spec.LOSS_ALIASES`, one table) are read too, so that the run directories written
with them keep loading (resume, ``--prefix-of``, the ladder's cells, the report rebuilds).
The spec is built once (:func:`pdmask.train.loss_spec.build_loss`) and every loss value is
checked there by the specs themselves; an error names the key as it was written. Unknown keys raise
``ValueError`` naming the key and listing the valid names; the other values are
type-checked against the field's type and :meth:`TrainConfig.validate` checks ranges and
choices. ``pdmask train --help-config`` prints the table of fields.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._validate import check_choice
from ..loss import PolicyLoss
from ..masks import get_mode
from .forwards import forward_for
from .loss_spec import (
    LOSS_ALIASES, MODE_RECORD, build_loss, coerce_leaf, flatten_loss, key_of, loss_fields, loss_help, loss_leaves,
    loss_path, mode_record, plain, put_path, read_as_recorded, resolved_fields, spec_fields, yaml_number,
)


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
    frozen_prefix_cache: str = _f("auto", "with train_blocks: the frozen blocks' hidden states are computed once per "
                                          "step (with anchor: old, in its forward) and the updates run the trained "
                                          "blocks only. auto: where that is bit for bit the plain forward (the first "
                                          "epoch); always: in every epoch (later ones equal to float rounding); never: "
                                          "the whole forward every time")
    # ---------------------------------------------------------------- the loss (docs/trainer.md)
    loss: Any = _f(None, "the policy loss, one pdmask.PolicyLoss: loss.mode, loss.estimator, loss.support, "
                         "loss.thresholds.*, loss.corrections.*, loss.sampling.* (the engine samples with it too), "
                         "loss.aggregation.*, loss.compute.*, loss.validate (a nested mapping in YAML, dotted keys "
                         "on the command line; short names in LOSS_ALIASES)")
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
    # ---------------------------------------------------------------- logging / checkpoints
    eval_every: int = _f(5, "held-out greedy accuracy every N steps (and at step 0 and the end)")
    eval_answers: int = _f(0, "save the greedy answers of the first N held-out prompts at each eval, in "
                              "eval_answers.jsonl beside metrics.jsonl (0: none), to read how answers drift")
    checkpoint_every: int = _f(10, "save a resumable checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk (older ones are deleted); with 2 or more a corrupt newest "
                                  "checkpoint falls back to the previous one on resume")
    tensorboard: bool = _f(True, "write TensorBoard event files next to metrics.jsonl")
    progress: bool = _f(True, "show a progress bar")

    # ------------------------------------------------------------------
    def __post_init__(self) -> None:
        # the loss: None (the trainer's default spec), a nested mapping of its fields, or a
        # PolicyLoss; the fields as given (a None delta: the mode's) are kept for to_dict
        if isinstance(self.loss, PolicyLoss):
            self._loss_fields = spec_fields(self.loss)
        else:
            given = self.loss if self.loss is not None else {}
            if not isinstance(given, Mapping):
                raise ValueError(f"loss: expected a pdmask.PolicyLoss or a mapping of its fields, got "
                                 f"{type(given).__name__}")
            self.loss, self._loss_fields = build_loss(loss_fields(given))

    @property
    def run_name(self) -> str:
        return self.name or f"{self.loss.mode}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.run_name

    @property
    def loss_fields(self) -> dict[str, Any]:
        """The loss spec's fields as a nested mapping, as given (a None delta stands for the
        mode's default, a None ``is_cap`` for 5): what ``config.yaml`` stores under ``loss``."""
        return copy.deepcopy(self._loss_fields)

    def loss_key(self, path: str) -> str:
        """The config key of the loss field ``path`` (``sampling.top_k``) for error messages:
        as the user wrote it, else its short name (:data:`LOSS_ALIASES`), else ``loss.<path>``."""
        return (getattr(self, "_loss_names", None) or {}).get(path) or key_of(path)

    def to_dict(self) -> dict[str, Any]:
        """The config as a run records it (config.yaml): the loss **resolved**, what the run uses
        (the mode's deltas, the IS cap in force, a preset's bounds; :func:`resolved_fields`), and
        under ``mode_spec`` the mode's surrogate and divergence (:func:`mode_record`). Loading it
        back gives the same run; :func:`replace` starts from the fields as given instead."""
        out = {}
        for f in dataclasses.fields(self):
            out[f.name] = plain(resolved_fields(self.loss)) if f.name == "loss" else getattr(self, f.name)
        out[MODE_RECORD] = mode_record(self.loss)
        return out

    def validate(self) -> "TrainConfig":
        """Range and choice checks; raises ValueError naming the field."""
        from ..engine.precision import PRECISIONS
        from ..engine.registry import engine_names
        from .tasks import TASKS

        for k, valid in {"arch": ("llama", "qwen3"), "task": TASKS, "engine_precision": PRECISIONS,
                         "engine": tuple(engine_names())}.items():
            check_choice(k, getattr(self, k), valid)
        self._validate_ranges()
        self._validate_shapes()
        _validate_loss(self)
        _validate_trainable(self)
        return self

    def _validate_ranges(self) -> None:
        for k, (lo, hi) in INT_RANGES.items():  # first: a huge int overflows C code later
            v = getattr(self, k)
            if v > hi:
                raise ValueError(f"{k}: must be at most {hi}{INT_WHY.get(k, '')}, got {v}")
            if v < lo and k in SEED_KEYS + ("eval_answers",):  # the other lower bounds: below, with reasons
                raise ValueError(f"{k}: must be >= {lo}{INT_WHY.get(k, '')}, got {v}")
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
        for k in ("lr", "sft_lr"):
            v = getattr(self, k)
            if not (v > 0) or math.isinf(v):
                raise ValueError(f"{k}: must be a positive number, got {v}")
        if not 0.0 <= self.sft_alt_format <= 1.0:
            raise ValueError(f"sft_alt_format: must lie in [0, 1], got {self.sft_alt_format}")
        for k in ("weight_decay", "grad_clip"):
            v = getattr(self, k)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{k}: must be a finite number >= 0{' (0: no clipping)' if k == 'grad_clip' else ''}, "
                                 f"got {v}")

    def _validate_shapes(self) -> None:
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


#: Seeds: torch's and numpy's generators take a seed below 2**32 (the data schedule multiplies it).
SEED_MAX = 2**32 - 1
#: Threads: more than any machine has (torch refuses values past a C int with an overflow).
THREADS_MAX = 1024
#: Every other integer key: a C int (a size, a count, a number of steps past it is no run).
INT_MAX = 2**31 - 1
SEED_KEYS = ("seed", "sft_seed", "task_seed")
#: Seeds per mode of an experiment (``pdmask compare / ladder / audit --seeds``): each is at
#: least one training run, so more is a typo, and planning them would not end.
MAX_SEEDS = 10_000
#: Processes run side by side (``--jobs``): more than a machine could run.
MAX_JOBS = 1024
#: The range of every integer key, checked by :meth:`TrainConfig.validate` before the rest
#: (the keys' lower bounds other than the seeds' and ``eval_answers``' come after, with their
#: reasons: ``steps >= 1``, ``train_blocks >= 0 (0: off)``, ...).
INT_RANGES: dict[str, tuple[int, int]] = {
    k: ((0, SEED_MAX) if k in SEED_KEYS else (1, THREADS_MAX) if k == "threads" else (0, INT_MAX))
    for k, tp in typing.get_type_hints(TrainConfig).items() if tp is int}
INT_WHY = {"threads": " (torch CPU threads; more than a machine has is a typo)",
           **dict.fromkeys(SEED_KEYS, " (a 32-bit seed, as torch's and numpy's generators take)")}


def check_loss_int(key: str, value: Any) -> None:
    """An integer loss field (``sampling.top_k``, ``compute.chunk_rows``, ``aggregation.dp_size``)
    within a C int, named as written, before the spec reads it."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
        raise ValueError(f"{key}: must be an integer of at most {INT_MAX}, got {value}")


def _forward_need(cfg: TrainConfig) -> str:
    return get_mode(cfg.loss.mode).extras[0]


def _validate_trainable(cfg: TrainConfig) -> None:
    """The trainable-parameter variant (train_blocks, lora_*) and loss_from: ranges, and
    the combinations the trainer cannot serve."""
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
    _validate_prefix_cache(cfg)
    check_choice("loss_from", cfg.loss_from, LOSS_FROM)
    if cfg.loss_from == "hidden":
        if forward_for(cfg.loss.mode) is not None:
            raise ValueError(f"loss_from: mode {cfg.loss.mode!r} computes its {_forward_need(cfg)} input on the "
                             "logits of its own forward; use loss_from=logits")
        if cfg.full_logits:
            raise ValueError("loss_from: hidden takes no rollout logits, and full_logits=true is for them (the "
                             f"*-full-* modes, the full-vocabulary mismatch metrics); use loss_from=logits "
                             f"(mode {cfg.loss.mode!r}) or full_logits=false")


def _validate_prefix_cache(cfg: TrainConfig) -> None:
    """``frozen_prefix_cache``: a choice; ``always`` (which asks for the cache in every epoch) only
    where there is a frozen prefix to cache and the update reads it."""
    from .frozen_prefix import PREFIX_CACHE

    check_choice("frozen_prefix_cache", cfg.frozen_prefix_cache, PREFIX_CACHE)
    if cfg.frozen_prefix_cache != "always":
        return
    if cfg.train_blocks < 1:
        raise ValueError("frozen_prefix_cache: always needs train_blocks >= 1 (with every block trained, nothing below "
                         "them is frozen); use auto or never")
    if forward_for(cfg.loss.mode) is not None:
        raise ValueError(f"frozen_prefix_cache: mode {cfg.loss.mode!r} runs its own forward (its batch direction), "
                         "which does not read the cache; use auto or never")


def _validate_loss(cfg: TrainConfig) -> None:
    """What the trainer asks of its loss spec beyond the spec's own checks: a registered mode
    name; the inputs the mode needs (the engine's full logits, a registered trainer forward);
    what truncated sampling excludes."""
    from .forwards import FORWARDS

    if not isinstance(cfg.loss.mode, str):
        raise ValueError(f"{cfg.loss_key('mode')}: the trainer config takes the name of a registered mode "
                         f"(pdmask.register_mode), got a {type(cfg.loss.mode).__name__}")
    mode = get_mode(cfg.loss.mode)
    if "full" in mode.needs and not cfg.full_logits:
        raise ValueError(f"full_logits: mode {mode.name!r} needs the engine's full logits; set full_logits=true")
    forward_for(mode)  # a mode needing an input that no registered trainer forward computes
    for fwd in FORWARDS.values():  # the settings each registered forward reads (batch_method)
        if fwd.check is not None:
            fwd.check(cfg)
    if not cfg.loss.sampling.truncated:
        return
    path = next(f"sampling.{k}" for k in ("top_k", "top_p", "min_p") if getattr(cfg.loss.sampling, k) is not None)
    on = cfg.loss_key(path)
    if cfg.full_logits:
        raise ValueError(f"{on}: truncated sampling cannot be combined with full_logits=true "
                         "(the full-vocabulary terms are those of the untruncated mu)")
    if forward_for(mode) is not None:
        raise ValueError(f"{on}: mode {mode.name!r} computes its {_forward_need(cfg)} direction on the untruncated "
                         "pi; truncated sampling is not available with it")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
#: ``loss_from`` values: the trainer's logits, or its final hidden states and LM-head weight.
LOSS_FROM = ("logits", "hidden")


def field_help() -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of every field, the loss's one row per leaf, for the CLI."""
    hints = typing.get_type_hints(TrainConfig)
    rows = []
    for f in dataclasses.fields(TrainConfig):
        if f.name != "loss":
            rows.append((f.name, _type_name(hints[f.name]), repr(f.default), f.metadata["help"]))
            continue
        defaults, help_ = loss_fields(), loss_help()
        short = {v: k for k, v in LOSS_ALIASES.items()}
        for path, tp in loss_leaves().items():
            d = defaults
            for part in path.split("."):
                d = d[part]
            alias = f" (short name: {short[path]})" if path in short else ""
            rows.append((f"loss.{path}", _type_name(tp), repr(d), f"{help_.get(path, '')}{alias}".strip()))
    return rows


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if args:
        return "|".join(getattr(a, "__name__", str(a)) if a is not type(None) else "null" for a in args)
    return getattr(tp, "__name__", str(tp))


def _unknown(key: str, where: str) -> ValueError:
    names = [*FIELDS, *LOSS_ALIASES, *(f"loss.{p}" for p in loss_leaves())]
    close = difflib.get_close_matches(key, names, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    fields = ", ".join(f for f in FIELDS if f != "loss")
    return ValueError(f"{key}: unknown config key in {where}{hint}; valid names are: {fields}, and the loss's "
                      "loss.<field> (pdmask train --help-config lists them)")


def is_config_key(key: str) -> bool:
    """``key`` names a config field, a loss field (``loss.corrections.is_cap``) or a short name."""
    return key in FIELDS or key in LOSS_ALIASES or key.startswith("loss.") and key[5:] in loss_leaves()


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
    if tp is str and isinstance(value, bool):  # YAML reads an unquoted yes/no/on/off/true/false as a bool
        raise ValueError(f"{key}: expected a string, got {value!r}: YAML reads an unquoted true/yes/on or "
                         f"false/no/off as a boolean; quote the value or give one of the key's named values")
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


def config_values(items, where: str) -> tuple[dict, dict, dict]:
    """``(fields, loss, names)`` of ``(key, value)`` pairs, later pairs winning: the
    TrainConfig fields, the loss's fields (nested, partial) and, for each loss path given,
    the key it was given by (error messages name the key as written). Keys are field names,
    ``loss`` (a mapping), ``loss.<path>`` or a short name of :data:`LOSS_ALIASES`."""
    top: dict[str, Any] = {}
    loss: dict[str, Any] = {}
    names: dict[str, str] = {}
    for k, v in items:
        if k == "loss":
            if not isinstance(v, Mapping):
                raise ValueError(f"loss: expected a mapping of the loss's fields (mode, thresholds, ...), got {v!r}")
            pairs = [(p, x, f"loss.{p}") for p, x in flatten_loss(v)]
        elif loss_path(k) is not None:
            pairs = [(loss_path(k), v, k)]
        elif k in FIELDS or k == MODE_RECORD:  # the record is checked against the mode (make_config)
            top[k] = v
            continue
        else:
            raise _unknown(k, where)
        for path, x, written in pairs:
            check_loss_int(written, x)
            put_path(loss, path, coerce_leaf(path, x))
            names[path] = written
    return top, loss, names


def make_config(values: dict[str, Any] | list, where: str = "config") -> TrainConfig:
    """A validated TrainConfig from a mapping (or ``(key, value)`` pairs) of config keys."""
    items = list(values.items()) if isinstance(values, Mapping) else list(values)
    top, loss, names = config_values(items, where)
    record = top.pop(MODE_RECORD, None)
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for k, v in top.items():
        if float in (hints[k], *typing.get_args(hints[k])):
            v = yaml_number(v)
        out[k] = _coerce(k, v)
    spec, fields_ = build_loss(loss_fields(loss), names)
    cfg = TrainConfig(**out, loss=spec)
    cfg._loss_fields, cfg._loss_names = fields_, names  # as given (a None delta), and as written
    _check_record(record, spec, where)
    return cfg.validate()


def _check_record(record, spec: PolicyLoss, where: str) -> None:
    """A config's ``mode_spec`` (a run's record of its mode) is what the mode is made of now: a
    mode registered anew under the same name with another surrogate or divergence is another
    loss, and a run recorded with the old one is not continued or compared under it."""
    if record is None:
        return
    now = mode_record(spec)
    if not isinstance(record, Mapping) or dict(record) != now:
        raise ValueError(f"{MODE_RECORD}: {where} records mode {spec.mask_mode.name!r} as {record!r}, but it is "
                         f"{now!r} now; a run made with the old mode cannot be continued or compared under its name")


def _yaml_where(e) -> str:
    """`` at line L, column C (problem)`` of a PyYAML error, on one line."""
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at} ({getattr(e, 'problem', None) or str(e).splitlines()[0]})"


def load_config(path: str | Path | None = None, overrides: list | dict | None = None) -> TrainConfig:
    """Read a YAML preset (``None``: defaults) and apply overrides (``key=value`` strings, a
    mapping, or ``(key, value)`` pairs, later ones winning); validated."""
    import yaml

    items: list = []
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
        config_values(list(data.items()), str(path))  # unknown keys named with the file
        items += list(data.items())
    if isinstance(overrides, Mapping):
        over = list(overrides.items())
    else:
        over = [o if isinstance(o, tuple) else parse_override(o) for o in (overrides or [])]
    config_values(over, "overrides")
    return make_config(items + over, where=str(path) if path else "config")


def replace(cfg: TrainConfig, changes: Mapping | None = None, **kw) -> TrainConfig:
    """A validated copy with ``changes`` (config keys as :func:`load_config` takes them,
    ``loss.corrections.is_cap`` or ``is_cap``; unknown keys raise like overrides)."""
    over = [*(changes or {}).items(), *kw.items()]
    config_values(over, "overrides")
    vals = {**cfg.to_dict(), "loss": plain(cfg.loss_fields)}  # as given: a changed mode takes its own deltas
    vals.pop(MODE_RECORD)
    return make_config([*vals.items(), *over])


# ------------------------------------------------------------------ stored runs
#: config keys that do not change a run's result (ignored when a stored run is compared with
#: a config: the ladder's cells, prefix cells); keep_checkpoints only decides how many
#: checkpoints stay on disk (its default went 1 -> 2 after the first ladder cells were run);
#: loss.validate only checks the inputs
NEUTRAL_KEYS = ("out_dir", "progress", "cache_dir", "tensorboard", "name", "keep_checkpoints", "loss.validate")


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


def stored_loss(stored: Mapping) -> dict[str, Any]:
    """The loss fields of a stored config (``config.yaml`` of any version: the nested
    ``loss`` mapping, or the short names of the flat config before it), nested and partial."""
    items = [(k, v) for k, v in stored.items() if k == "loss" or loss_path(k) is not None]
    return config_values(items, "the stored config")[1]


def comparable(values: Mapping) -> dict[str, Any]:
    """A config mapping (a stored ``config.yaml`` of any version, or ``TrainConfig.to_dict()``)
    flat, in the terms two configs are compared in: what the run used. ``loss.<path>`` keys
    hold the resolved loss (a run since issue 42 records it; an older record's ``null`` delta
    or ``is_cap`` is read as its value then, :func:`pdmask.train.loss_spec.read_as_recorded`,
    not as today's default), ``mode_spec`` the mode's surrogate and divergence (an older
    record's from the same table), the other fields as they are. A stored loss the specs
    refuse today is compared as given."""
    out = {k: v for k, v in values.items() if k in FIELDS and k != "loss"}
    out.update({k: v for k, v in values.items() if k not in FIELDS and loss_path(k) is None})  # unknown: kept
    given, record = read_as_recorded(loss_fields(stored_loss(values)), values.get(MODE_RECORD))
    try:
        spec = build_loss(given)[0]
        resolved, record = resolved_fields(spec), mode_record(spec) if record is None else record
    except ValueError:
        resolved = given
    out.update({f"loss.{p}": v for p, v in flatten_loss(plain(resolved))})
    if record is not None:
        out[MODE_RECORD] = plain(record)
    return out


def config_diff(stored: dict, cfg: TrainConfig) -> dict:
    """Keys whose stored value differs from ``cfg`` (results-neutral keys ignored), compared
    as :func:`comparable` puts them (a stored config of the flat version compares equal to
    the same settings in the nested one). A key the stored config lacks counts as equal
    when ``cfg`` holds the field's default: a field added to :class:`TrainConfig` after the
    run was made, at the value that keeps the old behaviour (loss fields a stored config
    lacks are their defaults already)."""
    have, want = comparable(stored), comparable(cfg.to_dict())
    keys = (set(have) | set(want)) - set(NEUTRAL_KEYS)
    out = {}
    for k in sorted(keys):
        if k not in have and k in FIELDS and want.get(k) == FIELDS[k].default:
            continue
        if have.get(k) != want.get(k):
            out[k] = (have.get(k), want.get(k))
    return out
