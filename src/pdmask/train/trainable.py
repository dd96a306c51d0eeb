"""Which parameters the trainer trains: all of them, the top N blocks, LoRA adapters, or both.

Config fields (:class:`pdmask.train.TrainConfig`), checked once in ``validate``:

- ``train_blocks = N`` (>= 1): the last N decoder blocks and the final norm train; the
  embeddings, the lower blocks and the LM head get ``requires_grad=False`` and are not in
  the optimizer. The LM head stays frozen whether tied or not. In SmolLM2 (tied) it *is*
  the input embedding, 28 M of the 135 M parameters: training it would move the bottom
  of the network too, which top-N is meant to leave alone. A frozen head also lets the
  backward skip ``dW = G^T h``, a (V, H) product.
- ``lora_rank = r`` (>= 1): peft LoRA adapters on the ``lora_targets`` linears of every
  block, or of the last ``train_blocks`` blocks when that is set too. The forward is
  ``y = x W^T + s (x A^T) B^T`` with ``s = lora_alpha / r``. ``A`` (r, in) starts at
  peft's Kaiming init, seeded by the config's ``seed``; ``B`` (out, r) starts at zero, so
  step 0 is the base model exactly. Dropout is 0. Only A and B train: no norm, no bias.

:func:`engine_state_dict` is what the rollout engine loads. It has the keys of the base
model. With LoRA, each adapted weight is merged as ``W + s B A``, computed on the side;
the trainer's model is not changed. The naive equivalent is peft's
``merge_and_unload()`` on a deep copy, then ``state_dict()``.
"""

from __future__ import annotations

import torch

#: the block linears of Llama / Qwen3 (attention and MLP): lora_targets' default
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the config fields of the variant (saved in each checkpoint; a resume must match them)
VARIANT_FIELDS = ("train_blocks", "lora_rank", "lora_alpha", "lora_targets")
ADAPTER = "default"  # peft's adapter name; the trainer has exactly one


def variant(cfg) -> dict:
    """The variant's config fields as a dict (what a checkpoint records)."""
    return {k: getattr(cfg, k) for k in VARIANT_FIELDS}


def lora_targets(cfg) -> list[str]:
    return [t.strip() for t in cfg.lora_targets.split(",")]


def import_peft():
    """``peft``, or a :class:`~pdmask.engine.registry.MissingExtra` naming the ``lora`` extra."""
    from ..engine.registry import MissingExtra

    try:
        import peft
    except ImportError as e:
        raise MissingExtra("lora", f"lora_rank: LoRA needs peft, the 'lora' extra: pip install -e '.[lora]' from a pdmask checkout "
                                   f"({e})") from None
    return peft


def decoder_parts(model: torch.nn.Module):
    """``(blocks, head, norm)`` of a decoder-only LM: the blocks are ``model.get_decoder().layers``
    (transformers Llama, Qwen2/Qwen3, Mistral, ...: ``model.model.layers``) or ``model.layers``
    for a plain module, the head ``model.get_output_embeddings()`` (else ``model.lm_head``),
    the final norm ``.norm`` of the decoder (or of the model) when there is one. Errors name
    ``params`` (the batch mask's argument that reads it; ``train_blocks`` here)."""
    dec = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    blocks = getattr(dec, "layers", None) if dec is not None else None
    if blocks is None:
        blocks = getattr(model, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"params: cannot find the decoder blocks of {type(model).__name__} (looked for "
                         "get_decoder().layers and .layers); pass params='all' or a list of parameter names")
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"params: cannot find the LM head of {type(model).__name__} (looked for "
                         "get_output_embeddings() and .lm_head); pass params='all' or a list of parameter names")
    norm = getattr(dec if dec is not None else model, "norm", None)
    return blocks, head, norm if isinstance(norm, torch.nn.Module) else None


def _blocks(model):
    blocks, _head, norm = decoder_parts(model)
    return blocks, norm


def apply_variant(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Freeze ``model`` to the config's variant and add the LoRA adapters, in place.

    Returns the same model, still a ``transformers`` causal LM (peft's
    ``inject_adapter_in_model``, not a ``PeftModel`` wrapper), so its forward, the
    greedy evaluation and the checkpoints are unchanged. Errors name the config key."""
    if not cfg.train_blocks and not cfg.lora_rank:
        return model
    blocks, norm = _blocks(model)
    L = len(blocks)
    if cfg.train_blocks > L:
        raise ValueError(f"train_blocks: {type(model).__name__} has {L} decoder blocks, got {cfg.train_blocks}")
    first = L - cfg.train_blocks if cfg.train_blocks else 0
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.lora_rank:
        _inject_lora(model, cfg, list(range(first, L)), blocks)
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    else:
        for b in blocks[first:]:
            b.requires_grad_(True)
        if norm is not None:
            norm.requires_grad_(True)
    return model


def _inject_lora(model, cfg, layers: list[int], blocks) -> None:
    peft = import_peft()
    want = lora_targets(cfg)
    inside = {n.rsplit(".", 1)[-1] for i in layers for n, m in blocks[i].named_modules()
              if isinstance(m, torch.nn.Linear)}
    missing = [t for t in want if t not in inside]
    if missing:
        raise ValueError(f"lora_targets: {missing[0]!r} names no linear layer in the adapted blocks of "
                         f"{type(model).__name__} (they have: {', '.join(sorted(inside))})")
    conf = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                           target_modules=want, layers_to_transform=layers, layers_pattern="layers")
    # A's init draws from the global RNG: seeded here and restored after, so the run's
    # other draws (and a resumed run's) do not depend on whether LoRA is on
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        peft.inject_adapter_in_model(conf, model, adapter_name=ADAPTER)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters with ``requires_grad`` (each tied tensor once), in ``model.parameters()`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"model: {type(model).__name__} has no parameter with requires_grad=True; nothing to train")
    return params


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> peft LoRA layer (a module with ``base_layer``, ``lora_A``, ``lora_B``, ``scaling``)."""
    return {n: m for n, m in model.named_modules()
            if hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)}


@torch.no_grad()
def engine_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's weights under the base model's names, with LoRA merged; what ``engine.load_weights`` takes.

    With no adapters this is ``model.state_dict()``. For each LoRA layer ``prefix`` the
    entries ``prefix.base_layer.weight`` and ``prefix.lora_{A,B}.*`` become one entry,
    ``prefix.weight = W + s B A``, computed in W's dtype. The bias, if any, keeps its
    name. The trainer's tensors are not changed, and the merged ones are new tensors.
    Naive equivalent: ``copy.deepcopy(PeftModel).merge_and_unload().state_dict()``."""
    sd = model.state_dict()
    layers = lora_layers(model)
    if not layers:
        return sd
    merged = {}
    for prefix, m in layers.items():
        if getattr(m, "merged", False) or getattr(m, "fan_in_fan_out", False):
            raise ValueError(f"model: LoRA layer {prefix!r} is merged or fan-in-fan-out; the trainer makes neither")
        A, B = m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight  # (r, in), (out, r)
        W = m.base_layer.weight  # (out, in)
        merged[prefix] = W + m.scaling[ADAPTER] * (B @ A).to(W.dtype)
    out = {}
    for k, v in sd.items():
        prefix, _, rest = k.partition(".base_layer.") if ".base_layer." in k else (k, "", "")
        if rest:  # a LoRA layer's base: weight merged, bias renamed
            out[f"{prefix}.{rest}"] = merged[prefix] if rest == "weight" else v
        elif ".lora_A." in k or ".lora_B." in k:
            continue
        else:
            out[k] = v
    return out
