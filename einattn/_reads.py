"""What a user's function reads besides its arguments (a ``MaskMod``'s, a ``ScoreMod``'s).

:func:`reached` follows what the function's code can reach: its closure, its defaults, the
globals its code names (its own and its inner functions'), a bound method's object, a
``functools.partial``'s arguments; within those, functions the same way, an ``nn.Module``'s
parameters, buffers and tensor attributes, the items of lists, tuples and dicts, the
attributes of plain objects. Two uses: the tensors a ScoreMod captures that want a gradient
(the chunked path hands them to its backward), and :func:`key`, which changes when what a
MaskMod reads is rebound (a global given a new tensor) or a tensor it reads is changed in
place (its version counter), so that a kept judgement is never reused for other data.
:func:`unseen` finds, in a probe's graph, a tensor wanting a gradient that none of those
explains (read through a path the search does not follow).
"""

from __future__ import annotations

import functools
import itertools
import types

import torch

DEPTH = 4  # how far from the function the search goes
ITEMS = 64  # the most items of one container (or attributes of one object) looked at


def reached(fn) -> list:
    """The objects ``fn`` reads, ``fn`` first, each once (by identity)."""
    out, seen = [], set()
    _walk(fn, 0, out, seen)
    return out


def _walk(item, depth: int, out: list, seen: set) -> None:
    if id(item) in seen:  # every object seen is held by ``out``: its id is its own
        return
    seen.add(id(item))
    out.append(item)
    if depth < DEPTH and not isinstance(item, torch.Tensor):
        for inner in _inside(item):
            _walk(inner, depth + 1, out, seen)


def _inside(item) -> list:
    """What one object holds that its code may read."""
    if isinstance(item, functools.partial):
        return [item.func, *item.args, *item.keywords.values()]
    if isinstance(item, types.MethodType):
        return [item.__self__, item.__func__]
    if isinstance(item, types.FunctionType):
        return _of_function(item)
    if isinstance(item, torch.nn.Module):
        return [*item.parameters(), *item.buffers(),
                *(v for v in vars(item).values() if isinstance(v, torch.Tensor))]
    if isinstance(item, (list, tuple)):
        return list(item[:ITEMS])
    if isinstance(item, dict):
        return list(itertools.islice(item.values(), ITEMS))
    if isinstance(item, (type, types.ModuleType, str, bytes)) or not hasattr(item, "__dict__"):
        return []
    return list(itertools.islice(vars(item).values(), ITEMS))


def _of_function(fn: types.FunctionType) -> list:
    """A function's closure, defaults and the globals named by its code and inner code."""
    cells = [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not fn]
    names, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    named = [fn.__globals__[k] for k in sorted(names) if k in fn.__globals__]
    return [*cells, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(), *named]


def tensors(fn) -> list:
    """The tensors ``fn`` reads."""
    return [t for t in reached(fn) if isinstance(t, torch.Tensor)]


class _Same:
    """An object compared by identity (a tensor's ``==`` is elementwise), held alive so that
    its id is never another's while a key holds it."""

    __slots__ = ("item",)

    def __init__(self, item) -> None:
        self.item = item

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.item is self.item

    def __hash__(self) -> int:
        return id(self.item)


def key(fn, versions: bool = True) -> tuple:
    """What ``fn`` reads as a key: each object by identity, each tensor with its version
    (without ``versions``, or for an inference tensor, which keeps none, by identity)."""
    return tuple((_Same(item), _version(item) if versions else None) for item in reached(fn))


def _version(item):
    if not isinstance(item, torch.Tensor) or item.is_inference():
        return None
    return item._version


def unseen(out: torch.Tensor, known) -> torch.Tensor | None:
    """A tensor that ``out``'s graph reaches and that wants a gradient, but is none of the
    ``known`` tensors nor behind one of them (None: there is none)."""
    seen = [t.grad_fn for t in known if t.grad_fn is not None]  # where the search stops
    nodes = [out.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or any(node is s for s in seen):
            continue
        seen.append(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            if not any(leaf is t for t in known):
                return leaf
            continue
        nodes += [next_node for next_node, _ in node.next_functions]
    return None
