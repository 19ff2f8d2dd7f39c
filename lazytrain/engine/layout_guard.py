"""Refuses to train a model changed in place after ``initialize``: the engine laid its streamed layer buffers,
fp32 masters, gradient buffers, optimizer groups and plan out for the parameters it found then. A module or
parameter put in place of one of those trains outside them: before this, a resized or replaced LM head was
silently never updated, and a block's replaced projection was never used (the executor streamed the old
weights in by name).

- Hugging Face's ``resize_token_embeddings`` is refused before it starts (unless it would change nothing): it
  swaps the embedding's data in place, which no check of the parameters' identity sees, and then replaces the
  head.
- Each pass (the engine's forward, and the first block's call when a script calls the model itself) checks
  that every parameter found at set-up is still in the model: along the module paths it was found on, by
  identity (a few tenths of a microsecond a parameter); where a path changed, whether it is anywhere in the
  model (a wrapper that keeps the original module, as PEFT's ``modules_to_save`` does, is no change) and, if
  so, it is watched on its new path. A change made in several assignments (a merge of adapters) is refused
  once, whole, not half-way."""
from __future__ import annotations

from torch import nn


class ModelChangedError(RuntimeError):
    """A parameter of a model in an engine left it, or its vocabulary was to be resized."""


class LayoutGuard:
    """The model's parameters as set-up found them: :meth:`check` refuses a pass once any left the model."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._params = {id(p): p for p in model.parameters()}
        self._record()
        # a Hugging Face model's (a PEFT model's inner one too): refused on the instance, before it changes
        # anything; an instance's own attribute of that name is put back by remove()
        self._resizers = {id(m): (m, vars(m).get("resize_token_embeddings")) for m in model.modules()
                          if hasattr(type(m), "resize_token_embeddings")}
        for m, _ in self._resizers.values():
            m.resize_token_embeddings = _ResizeRefusal(m)

    def _record(self) -> None:
        """Every (parent, name, child) on the way to the parameters, and each (module, name, parameter)."""
        self._edges: list[tuple[nn.Module, str, nn.Module]] = []
        self._slots: list[tuple[nn.Module, str, nn.Parameter, str]] = []
        seen_edges = set()
        for path, p in self._model.named_parameters(remove_duplicate=False):
            if id(p) not in self._params:
                continue   # added since set-up and left alone here (the executor streams what set-up found)
            *parents, name = path.split(".")
            module = self._model
            for child_name in parents:
                child = module._modules[child_name]
                if (id(module), child_name) not in seen_edges:
                    seen_edges.add((id(module), child_name))
                    self._edges.append((module, child_name, child))
                module = child
            self._slots.append((module, name, p, path))

    def check(self) -> None:
        if all(parent._modules.get(name) is child for parent, name, child in self._edges) and \
                all(module._parameters.get(name) is p for module, name, p, _ in self._slots):
            return
        present = {id(p) for p in self._model.parameters()}
        gone = [path for _, _, p, path in self._slots if id(p) not in present]
        if gone:
            raise ModelChangedError(
                f"'{gone[0]}'{f' and {len(gone) - 1} more parameters' if len(gone) > 1 else ''} found at "
                f"initialize() no longer in the model: it was changed in place since (a new head, a module "
                f"replaced, PEFT's merge_and_unload()). LazyTrain trains the parameters it found then, and a new "
                f"one would not be updated: change the model before lazytrain.initialize, or after "
                f"engine.destroy(), which hands it back")
        self._record()   # the same parameters, some on other paths now: watched there

    def remove(self) -> None:
        """The model handed back: its own ``resize_token_embeddings`` again."""
        for m, own in self._resizers.values():
            if isinstance(vars(m).get("resize_token_embeddings"), _ResizeRefusal):
                del m.resize_token_embeddings
                if own is not None:
                    m.resize_token_embeddings = own
        self._resizers = {}


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
