"""Refuses to train a model changed in place after ``initialize``: the engine laid its streamed layer buffers,
fp32 masters, gradient buffers, optimizer groups and plan out for the parameters it found then. A module or
parameter put in place of one of those trains outside them: before this, a resized or replaced LM head was
silently never updated, and a block's replaced projection was never used (the executor streams the weights it
recorded in by name).

- Hugging Face's ``resize_token_embeddings`` is refused before it starts (unless it would change nothing): it
  swaps the embedding's data in place, which no check of the parameters' identity sees, and then replaces the
  head.
- Every training pass (the engine's forward, and the first block's call when a script calls the model), and any
  other pass after a module or parameter was assigned into one of the model's modules (torch's registration
  hooks mark the guard), the model is verified: each parameter found at set-up still there, by identity along
  its module paths (a few tenths of a microsecond a parameter); where a path changed, a parameter outside the
  blocks may have moved (a wrapper that keeps the original module, as PEFT's ``modules_to_save`` does) but a
  block's must keep its name through the blocks' list, and the list must stay in the model (the executor runs
  the list's entries and streams their weights in under those names; an alias elsewhere is no change); and no
  parameter added since that requires grad (it would never be updated). A change made in several assignments
  (a merge of adapters) is refused once, whole.
- A parameter's tensor replaced (``p.data = ...``, or ``model.to()``/``.half()`` on the model, which assign
  ``.data``) is refused at the next training pass where the engine cannot follow it: a streamed block's
  parameter given any other storage (the blocks stream from, and the optimizer updates, the engine's flat
  buffers, so the new tensor was never computed with), any other parameter given another shape, dtype or
  device (its gradient, master and optimizer state keep the old ones: a step wrote past a gradient's end and
  crashed the process). Another parameter given a tensor like its own (transformers' ``tie_weights()`` pads a
  tied head's bias that way) is what the engine computes with, as a write into it is, and the next step
  writes its master over it. Stage 3's partitioned parameters, which the engine itself fetches and drops
  around each forward, are not looked at.
- Writes that bypass ``nn.Module.__setattr__`` (``module._parameters[...] = ...``, ``del``) and tensors replaced
  are seen at the next training pass only, except a streamed block parameter given another storage, which an
  evaluation pass refuses too (it would compute with the old weights); a same-address view (reshaped,
  transposed) is left to the next training pass."""
from __future__ import annotations

import operator
import weakref

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)


class ModelChangedError(RuntimeError):
    """A parameter of a model in an engine left it or moved, one was added that trains, or its vocabulary was to
    be resized."""


_BEFORE_OR_AFTER = "change the model before lazytrain.initialize, or after engine.destroy(), which hands it back"
_WAY_OUT = f"LazyTrain trains the parameters it found then, and a new one would not be updated: {_BEFORE_OR_AFTER}"


def _walk(model: nn.Module):
    """(parent, name, child, child's path) over the module tree as ``_modules`` holds it (a wrapper's own
    ``named_parameters``, as torch's checkpoint wrapper's, may name them otherwise), each module entered once."""
    entered = {id(model)}
    stack = [(model, "", iter(list(model._modules.items())))]   # depth first, in order, as named_modules
    while stack:
        module, path, children = stack[-1]
        for name, child in children:
            if child is None:
                continue
            child_path = f"{path}.{name}" if path else name
            yield module, name, child, child_path
            if id(child) not in entered:
                entered.add(id(child))
                stack.append((child, child_path, iter(list(child._modules.items()))))
            break
        else:
            stack.pop()


def _slots(model: nn.Module):
    """(module, name, parameter, path) for every parameter slot, each module under the first path found to it (a
    module shared by several parents is not walked again: the paths stay as many as the modules)."""
    seen = set()
    for module, path in [(model, "")] + [(child, p) for _, _, child, p in _walk(model)]:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param, f"{path}.{name}" if path else name


def _at(model: nn.Module, path: str):
    """The parameter at ``path`` through ``_modules`` and ``_parameters`` (None where nothing is)."""
    *parents, name = path.split(".")
    module = model
    for child in parents:
        module = module._modules.get(child)
        if module is None:
            return None
    return module._parameters.get(name)


class LayoutGuard:
    """The model's parameters as set-up found them (``blocks``: the list of streamed blocks, whose entries the
    executor runs, streaming their weights in under their names in them): :meth:`check` refuses a pass once the
    model no longer holds them as they were."""

    def __init__(self, model: nn.Module, blocks, swapped=()):
        """``swapped``: parameters whose tensor the engine itself replaces between passes (stage 3's
        partitioned ones): their storage is not watched."""
        self._model = model
        self._params: dict[int, nn.Parameter] = {}
        self._names: dict[int, str] = {}   # each parameter's first path at set-up, for messages
        for _, _, p, path in _slots(model):
            self._params.setdefault(id(p), p)
            self._names.setdefault(id(p), path)
        # each block's weights under their names in the blocks' list (the executor runs the list's entry i and
        # streams its weights in under their names in it), and that list in the model
        self._blocks = blocks if blocks is not None and len(blocks) else None
        self._streamed_at = [(f"{i}.{path}", p) for i, block in enumerate(blocks or ())
                             for _, _, p, path in _slots(block)]
        self._blocks_at = next((path for _, _, child, path in _walk(model) if child is self._blocks), None)
        self._record()
        # each parameter's tensor as set-up laid it out: a streamed block's, its view of the engine's buffers
        # (storage address, shape, strides and dtype: a view of the same address reshaped, transposed or
        # reinterpreted is not what the blocks stream); any other's, its shape, dtype and device
        skip = {id(p) for p in swapped}
        self._streamed_ids = {id(p) for _, p in self._streamed_at}
        self._streamed_params = [p for i, p in self._params.items() if i in self._streamed_ids and i not in skip]
        self._streamed_views = _views_of(self._streamed_params)
        self._other_params = [p for i, p in self._params.items() if i not in self._streamed_ids and i not in skip]
        self._other_kinds = list(map(_kind_of, self._other_params))
        self._laid_out = {id(p): _described(p) for p in self._params.values()}
        self._dirty = False
        # torch's hooks are global: they hold the guard weakly (an engine never destroyed is still collected, and
        # its hooks go with it), and mark it only for an assignment into a module of this model (a ModuleList
        # slice that Llama's forward takes builds a new list through add_module: not this model's)
        guard = weakref.ref(self)

        def mark(module, *args):
            g = guard()
            if g is not None and id(module) in g._watched:
                g._dirty = True
        self._hooks = [register_module_parameter_registration_hook(mark),
                       register_module_module_registration_hook(mark)]
        weakref.finalize(self, _remove_hooks, list(self._hooks))
        # a Hugging Face model's (a PEFT model's inner one too): refused on the instance, before it changes
        # anything; an instance's own attribute of that name is put back by remove()
        self._resizers = {id(m): (m, vars(m).get("resize_token_embeddings")) for m in model.modules()
                          if hasattr(type(m), "resize_token_embeddings")}
        for m, _ in self._resizers.values():
            m.resize_token_embeddings = _ResizeRefusal(m)

    def _record(self) -> None:
        """The module tree as it is (each module's children and parameter slots, by identity and count), and the
        parameters in it that set-up did not find (frozen ones may stay): the fast check compares against these."""
        edges = list(_walk(self._model))
        modules = [self._model] + list({id(c): c for _, _, c, _ in edges}.values())
        self._edges = [(parent, name, child) for parent, name, child, _ in edges]
        self._counts = [(m, len(m._modules), len(m._parameters)) for m in modules]
        self._watched = {id(m) for m in modules}   # held by _counts: no id reused while watched
        self._slots = [(m, name, p) for m in modules for name, p in m._parameters.items() if p is not None]
        self._unknown = [p for _, _, p in self._slots if id(p) not in self._params]

    def _unchanged(self) -> bool:
        return all(len(m._modules) == n and len(m._parameters) == k for m, n, k in self._counts) and \
            all(parent._modules.get(name) is child for parent, name, child in self._edges) and \
            all(module._parameters.get(name) is p for module, name, p in self._slots) and \
            not any(p.requires_grad for p in self._unknown) and \
            _views_of(self._streamed_params) == self._streamed_views and \
            list(map(_kind_of, self._other_params)) == self._other_kinds

    def check(self, training: bool) -> None:
        """Refuses the pass where the model changed. An evaluation pass with nothing assigned into a module
        compares only the streamed block parameters' storage addresses (a block given a new tensor would compute
        with its old weights, silently; about 50 ns a parameter, where the whole check takes some 300)."""
        if not (training or self._dirty) and \
                list(map(torch.Tensor.data_ptr, self._streamed_params)) == self._streamed_views[0]:
            return
        if self._unchanged():
            self._dirty = False
            return
        slots = list(_slots(self._model))
        now = {}
        for _, _, p, path in slots:
            now.setdefault(id(p), path)
        gone = [self._names[i] for i in self._params if i not in now]   # in the model's order
        if gone:
            more = f" and {len(gone) - 1} more parameters" if len(gone) > 1 else ""
            raise ModelChangedError(f"'{gone[0]}'{more} found at initialize() no longer in the model: it was "
                                    f"changed in place since (a new head, a module replaced, PEFT's "
                                    f"merge_and_unload()). {_WAY_OUT}")
        # the blocks' list must stay in the model and each block's weight under its name through it (the executor
        # runs the list's entries and streams their weights in under those names); other paths to it (an alias
        # of its module, added or taken away since) are no change
        if self._blocks is not None and self._blocks is not self._model and \
                all(child is not self._blocks for _, _, child, _ in _walk(self._model)):
            raise ModelChangedError(f"'{self._blocks_at}', the list of streamed blocks found at initialize(), is no "
                                    f"longer in the model: the engine runs the blocks of that list. {_WAY_OUT}")
        moved = [p for path, p in self._streamed_at if _at(self._blocks, path) is not p]
        if moved:
            p = moved[0]
            raise ModelChangedError(f"'{self._names[id(p)]}', a streamed block's weight, is now at '{now[id(p)]}': "
                                    f"the blocks' weights stream under the names found at initialize(), and a module "
                                    f"wrapped since would not be trained. {_WAY_OUT}")
        added = next((path for _, _, p, path in slots if p.requires_grad and id(p) not in self._params), None)
        if added:
            raise ModelChangedError(f"'{added}' was added to the model after initialize() and requires grad: "
                                    f"{_WAY_OUT}")
        views = zip(self._streamed_params, zip(*_views_of(self._streamed_params)), zip(*self._streamed_views))
        replaced = {id(p) for p, view, laid_out in views if view != laid_out} | \
            {id(p) for p, kind in zip(self._other_params, self._other_kinds) if _kind_of(p) != kind}
        p = next((q for q in self._params.values() if id(q) in replaced), None)   # the first in the model's order
        if p is not None:
            why = ("a streamed block's weights stream from the engine's buffers, which the step updates, so a new "
                   "tensor would never be computed with" if id(p) in self._streamed_ids else
                   "its gradient, master and optimizer state keep the shape, dtype and device found then")
            raise ModelChangedError(
                f"'{now[id(p)]}' holds another tensor than the one found at initialize() ({self._laid_out[id(p)]} "
                f"then, {_described(p)} now): its .data was assigned, or the model moved or cast (model.to(), "
                f".half()), and {why}. Write values into the parameter in place (under torch.no_grad()), or set "
                f"them with lazytrain.utils.safe_set_full_fp32_param(p, values) (DeepSpeed's name), or "
                f"{_BEFORE_OR_AFTER}")
        # moved outside the blocks (a wrapper keeps the original): watched, and named, where it is now
        self._names = {i: now[i] for i in self._params}
        self._record()
        self._dirty = False

    def remove(self) -> None:
        """The model handed back: no hooks of the guard's, its own ``resize_token_embeddings`` again."""
        _remove_hooks(self._hooks)
        self._hooks = []
        for m, own in self._resizers.values():
            if isinstance(vars(m).get("resize_token_embeddings"), _ResizeRefusal):
                del m.resize_token_embeddings
                if own is not None:
                    m.resize_token_embeddings = own
        self._resizers = {}


def _views_of(params: list) -> tuple:
    """Each parameter's storage address, shape, strides and dtype, as four lists (mapped: about half the time
    a tuple a parameter takes)."""
    return (list(map(torch.Tensor.data_ptr, params)), list(map(_SHAPE, params)),
            list(map(torch.Tensor.stride, params)), list(map(_DTYPE, params)))


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def _kind_of(p: nn.Parameter) -> tuple:
    return p.shape, p.dtype, p.device


def _described(p: nn.Parameter) -> str:
    strides = "" if p.is_contiguous() else f" strides {p.stride()}"
    return f"{p.dtype} {tuple(p.shape)}{strides} on {p.device}"


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()   # a second removal does nothing


class _ResizeRefusal:
    """``resize_token_embeddings`` on a model in an engine: a call that would change nothing (no size, or the
    embedding's own with no padding multiple) goes through."""

    def __init__(self, module: nn.Module):
        self._module = module

    def __call__(self, new_num_tokens=None, pad_to_multiple_of=None, *args, **kwargs):
        m = self._module
        same = new_num_tokens is None or new_num_tokens == m.get_input_embeddings().weight.shape[0]
        if same and pad_to_multiple_of is None:
            return type(m).resize_token_embeddings(m, new_num_tokens, pad_to_multiple_of, *args, **kwargs)
        raise ModelChangedError(
            "resize_token_embeddings after lazytrain.initialize: the engine laid its fp32 masters, gradients and "
            "optimizer state out for the embedding and head it was given, and resized ones would train outside "
            "them (a resized head would never be updated). Resize before lazytrain.initialize (with a Trainer: "
            "before building it), or call engine.destroy() and initialize again")
