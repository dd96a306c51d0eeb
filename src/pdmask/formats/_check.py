"""Element checks shared by the engine-format converters.

Engine outputs arrive as Python lists, dicts and objects (or JSON of them), so a wrong
type, a ``None`` or a float id would otherwise surface as a raw ``TypeError`` /
``IndexError`` from deep inside, naming nothing. Every helper here raises one
``ValueError`` that starts with the user-facing argument and says which field of which
position (``sequence b, token t``) is wrong:

    logprobs: sequence 1, token 3: token id 5.0 in FlatLogprobs.token_ids[12] must be an int, got float

Token ids must be Python or NumPy integers (or an integer tensor): a float id is refused,
never truncated. Log-probs must be real numbers. Lists of many elements are converted in
one ``torch.tensor`` call; the per-element scan that finds the culprit runs only when the
conversion or the type test fails.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import torch


def is_int(x) -> bool:
    t = type(x)
    if t is int:  # the common case first: the ABC check below is slow
        return True
    return t is not bool and isinstance(x, numbers.Integral)


def is_real(x) -> bool:
    t = type(x)
    if t is float or t is int:
        return True
    return t is not bool and isinstance(x, numbers.Real)


def _tname(x) -> str:
    return type(x).__name__


def fail(arg: str, where: str, msg: str):
    raise ValueError(f"{arg}: {where}: {msg}" if where else f"{arg}: {msg}")


def token_id(x, arg: str, where: str, field: str = "token id") -> int:
    """``x`` as an int token id >= 0 (a float, bool, None or string is refused)."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() and x.dtype != torch.bool:
        x = x.item()
    if not is_int(x):
        fail(arg, where, f"{field} must be an int, got {x!r} ({_tname(x)})")
    if x < 0:
        fail(arg, where, f"{field} must be >= 0, got {int(x)}")
    return int(x)


def logprob(x, arg: str, where: str, field: str = "log-prob", none=None) -> float:
    """``x`` as a float log-prob; ``None`` becomes ``none`` when given, else is refused."""
    if x is None and none is not None:
        return none
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dtype != torch.bool and not x.is_complex():
        x = x.item()
    if not is_real(x):
        fail(arg, where, f"{field} must be a number, got {x!r} ({_tname(x)})")
    return float(x)


def setting(name: str, v, default, *, integer: bool = False):
    """A sampling setting (``temperature``, ``top_p``, ``top_k``, ...): ``default`` for
    None, else a real number (an int for ``integer``); a string, bool or NaN is refused
    with one line naming the setting (a YAML or command-line value left unconverted)."""
    if v is None:
        return default
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype != torch.bool and not v.is_complex():
        v = v.item()
    if integer:
        if not is_int(v):
            fail(name, "", f"must be an int or None, got {v!r} ({_tname(v)})")
        return int(v)
    if not is_real(v) or math.isnan(v):
        fail(name, "", f"must be a number or None, got {v!r} ({_tname(v)})")
    return float(v)


def as_sequence(x, arg: str, where: str, what: str) -> Sequence:
    """``x`` if it is a list-like (list, tuple, tensor, array; not a string or a mapping)."""
    if isinstance(x, (str, bytes, Mapping)) or not hasattr(x, "__len__") or not hasattr(x, "__getitem__"):
        fail(arg, where, f"expected {what}, got {_tname(x)}")
    return x


def token_ids(seq, arg: str, where: str) -> list[int]:
    """A sequence's sampled ids as a list of ints (integer tensors and arrays accepted)."""
    if isinstance(seq, torch.Tensor):
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool or seq.dim() != 1:
            fail(arg, where, f"expected a 1-D integer tensor of token ids, got {seq.dtype} {tuple(seq.shape)}")
        seq = seq.tolist()
    else:
        seq = as_sequence(seq, arg, where, "a list of token ids")
    out = []
    for t, x in enumerate(seq):
        out.append(token_id(x, arg, f"{where}, token {t}" if where else f"token {t}"))
    return out


def _has_bool(vals: list) -> bool:
    return any(type(x) is bool for x in vals)  # torch.tensor would read True as 1


def int_tensor(values, arg: str, field: str, where_of: Callable[[int], str], *, none: int | None = None,
               minimum: int | None = 0) -> torch.Tensor:
    """An int64 tensor of ``values`` (None -> ``none`` when given); a float, bool or other
    element is refused with ``where_of(i)`` naming its position."""
    if isinstance(values, torch.Tensor):
        t = values.reshape(-1)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            fail(arg, "", f"{field} must hold ints, got a {t.dtype} tensor")
        t = t.long()
    else:
        vals = list(values)
        try:
            t = torch.tensor(vals) if vals else torch.zeros(0, dtype=torch.int64)
            ok = (t.dim() == 1 and t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
                  and not _has_bool(vals))
        except (TypeError, ValueError, RuntimeError, OverflowError):
            ok = False
        if not ok:
            for i, x in enumerate(vals):
                if x is None and none is not None:
                    continue
                if not is_int(x):
                    fail(arg, where_of(i), f"{field}[{i}] must be an int, got {x!r} ({_tname(x)})")
            t = torch.tensor([none if x is None else int(x) for x in vals], dtype=torch.int64)
        t = t.long()
    if minimum is not None and t.numel():
        low = t < minimum
        if none is not None:
            low &= t != none
        if bool(low.any()):
            i = int(low.nonzero()[0, 0])
            fail(arg, where_of(i), f"{field}[{i}] must be >= {minimum}, got {int(t[i])}")
    return t


def float_tensor(values, arg: str, field: str, where_of: Callable[[int], str], *,
                 none: float | None = None) -> torch.Tensor:
    """A float64 tensor of ``values`` (None -> ``none`` when given, else refused)."""
    if isinstance(values, torch.Tensor):
        t = values.reshape(-1)
        if t.is_complex() or t.dtype == torch.bool:
            fail(arg, "", f"{field} must hold numbers, got a {t.dtype} tensor")
        return t.double()
    vals = list(values)
    if not _has_bool(vals):
        try:
            t = torch.tensor(vals, dtype=torch.float64) if vals else torch.zeros(0, dtype=torch.float64)
            if t.dim() == 1:
                return t
        except (TypeError, ValueError, RuntimeError):
            pass
    for i, x in enumerate(vals):
        if x is None and none is not None:
            continue
        if not is_real(x):
            fail(arg, where_of(i), f"{field}[{i}] must be a number, got {x!r} ({_tname(x)})")
    return torch.tensor([none if x is None else float(x) for x in vals], dtype=torch.float64)
