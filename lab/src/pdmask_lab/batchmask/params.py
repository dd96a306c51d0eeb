"""Which parameters theta the batch-aware mask differentiates: ``params=``.

- ``"all"``: every trainable parameter (``requires_grad``) of the model.
- ``N`` (int >= 1): the last N decoder blocks, the final norm and the LM head — the
  cheaper variant. Blocks are found as ``model.get_decoder().layers`` (transformers
  Llama, Qwen2/Qwen3, Mistral, ...: ``model.model.layers``), or ``model.layers`` for a
  plain module; the head is ``model.get_output_embeddings()`` (else ``model.lm_head``);
  the final norm is ``.norm`` of the decoder (or of the model) when there is one.
- a list of parameter names (``model.named_parameters()``): exactly those.

Tied embeddings. With ``tie_word_embeddings`` the head's weight *is* the input
embedding. The subset is a set of parameter **names** (uses), and each selected name is
a separate differentiable input of the forward (:func:`torch.func.functional_call` with
``tie_weights=False``); names that are selected together and share one tensor share one
input. So ``"all"`` moves the shared matrix through both of its uses (its ordinary
gradient), while ``N`` moves ``lm_head.weight`` as the output projection only and keeps
the input embedding fixed: the backward and the forward-mode pass then never go below
block ``L - N``. The preconditioner of such an input is that of the shared parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmask.train.trainable import decoder_parts


@dataclass
class TopBlocks:
    """The modules of the last-N variant with their qualified names: ``blocks`` and ``head``
    as ``(name, module)``, ``norm`` likewise or None (see :mod:`.top`)."""

    blocks: list
    norm: tuple | None
    head: tuple


@dataclass
class ParamSubset:
    """A differentiable view of a model's parameters.

    ``params[j]`` is the parameter behind input j (for the optimizer's state) and
    ``names[j]`` the names it is used under; every other name is held fixed.
    """

    all_names: list  # every parameter name of the model, tied duplicates included
    fixed: dict  # name -> parameter for the names held fixed
    names: list  # names[j]: the selected names of input j
    params: list  # params[j]: the parameter behind input j
    top: TopBlocks | None = None  # params=N: the modules the selection covers

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def leaves(self) -> list[torch.Tensor]:
        """Fresh detached inputs (sharing storage with the parameters)."""
        return [p.detach() for p in self.params]

    def aliases(self) -> list[torch.Tensor]:
        """Differentiable views of the parameters, one per input: a gradient taken with
        respect to alias j counts only the uses the subset selected (a tied head's output
        projection, not its input embedding), while a loss on the same forward still
        back-propagates into the parameter through the view."""
        return [p.view_as(p) for p in self.params]

    def tensors(self, inputs, *, live: bool = False) -> dict[str, torch.Tensor]:
        """The ``functional_call`` dict: input j under each of its names, the rest detached
        (``live``: the rest are the parameters themselves, so a loss on the same forward
        reaches every parameter)."""
        out = {n: (p if live else p.detach()) for n, p in self.fixed.items()}
        for names, x in zip(self.names, inputs):
            for n in names:
                out[n] = x
        return out


def _module_name(model, module) -> str:
    return next(n for n, m in model.named_modules(remove_duplicate=False) if m is module)


def top_blocks(model, n: int) -> TopBlocks:
    """The last ``n`` blocks, the final norm and the head of ``model`` with their names."""
    blocks, head, norm = decoder_parts(model)
    if not 1 <= n <= len(blocks):
        raise ValueError(f"params: the number of last blocks must lie in [1, {len(blocks)}], got {n}")
    named = [(_module_name(model, b), b) for b in blocks[len(blocks) - n:]]
    return TopBlocks(named, (_module_name(model, norm), norm) if norm is not None else None,
                     (_module_name(model, head), head))


def _selected_names(model, params, all_names: list[str]) -> list[str]:
    if isinstance(params, str):
        if params != "all":
            raise ValueError(f"params: unknown value {params!r}; use 'all', an int N (last N blocks + head) "
                             "or a list of parameter names")
        return list(all_names)
    if isinstance(params, int) and not isinstance(params, bool):
        top = top_blocks(model, params)
        mods = top.blocks + [top.head] + ([top.norm] if top.norm is not None else [])
        prefixes = tuple(name + "." for name, _ in mods)
        return [n for n in all_names if n.startswith(prefixes)]
    if isinstance(params, (list, tuple)) and all(isinstance(n, str) for n in params):
        unknown = [n for n in params if n not in all_names]
        if unknown:
            raise ValueError(f"params: unknown parameter name {unknown[0]!r} (names come from model.named_parameters())")
        return list(dict.fromkeys(params))
    raise ValueError(f"params: expected 'all', an int or a list of parameter names, got {type(params).__name__}")


def select_params(model: torch.nn.Module, params="all") -> ParamSubset:
    """The :class:`ParamSubset` of ``params`` (frozen parameters are never selected)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: must be a torch.nn.Module returning logits, got {type(model).__name__}")
    named = list(model.named_parameters(remove_duplicate=False))
    by_name = dict(named)
    chosen = [n for n in _selected_names(model, params, [n for n, _ in named]) if by_name[n].requires_grad]
    if not chosen:
        raise ValueError(f"params: selects no trainable parameter of {type(model).__name__}")
    groups: dict[int, list[str]] = {}
    for n in chosen:
        groups.setdefault(id(by_name[n]), []).append(n)
    names = list(groups.values())
    chosen_set = set(chosen)
    fixed = {n: p for n, p in named if n not in chosen_set}
    top = top_blocks(model, params) if isinstance(params, int) and not isinstance(params, bool) else None
    return ParamSubset([n for n, _ in named], fixed, names, [by_name[ns[0]] for ns in names], top)
