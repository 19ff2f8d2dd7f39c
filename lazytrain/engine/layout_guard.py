"""Refuses to train a model changed in place after ``initialize``: the engine laid its fp32 masters, gradient
buffers, optimizer groups and plan out for the parameters it found then. A parameter outside the streamed blocks
put in place of one of those (a new LM head, ``resize_token_embeddings``, PEFT's ``merge_and_unload()`` of a head
adapter) trains outside them: before this, a resized head was silently never updated. The blocks are checked
by the executor, which streams each block's weights by the names it recorded.

- Hugging Face's ``resize_token_embeddings`` is refused before it starts: it swaps the embedding's data in
  place, which no check of the parameters' identity sees, and then replaces the head.
- The parameters outside the blocks are checked at each forward, by identity, along their module paths:
  a change made in several assignments (a merge of adapters) is refused once, whole, not half-way."""
from __future__ import annotations

from torch import nn


class ModelChangedError(RuntimeError):
    """A parameter of a model in an engine was replaced, or its vocabulary was to be resized."""


class LayoutGuard:
    """The model's parameters outside the streamed blocks, as set-up found them: :meth:`check` refuses a
    forward once any was replaced (itself, or a module on its path)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter]):
        ours = {id(p) for p in params}
        # every (parent, name, child) on the way to them, and each (module, name, parameter): checked by identity
        self._edges: dict[tuple[int, str], tuple[nn.Module, str, nn.Module, str]] = {}
        self._slots: list[tuple[nn.Module, str, nn.Parameter, str]] = []
        for path, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in ours:
                continue
            *parents, name = path.split(".")
            module = model
            for i, child_name in enumerate(parents):
                child = module._modules[child_name]
                self._edges.setdefault((id(module), child_name), (module, child_name, child, ".".join(parents[:i + 1])))
                module = child
            self._slots.append((module, name, p, path))
        # a Hugging Face model's (a PEFT model's inner one too): refused on the instance, before it changes anything
        self._resizers = [m for m in model.modules() if hasattr(type(m), "resize_token_embeddings")]
        for m in self._resizers:
            m.resize_token_embeddings = _refuse_resize

    def check(self) -> None:
        for parent, name, child, path in self._edges.values():
            if parent._modules.get(name) is not child:
                _refuse(path, "a module")
        for module, name, param, path in self._slots:
            if module._parameters.get(name) is not param:
                _refuse(path, "a parameter")

    def remove(self) -> None:
        """The model handed back: its own ``resize_token_embeddings`` again."""
        for m in self._resizers:
            if vars(m).get("resize_token_embeddings") is _refuse_resize:
                del m.resize_token_embeddings
        self._resizers = []


def _refuse(path: str, what: str) -> None:
    raise ModelChangedError(
        f"'{path}' is not {what} initialize() found: the model was changed in place since (a new head, "
        f"PEFT's merge_and_unload()). LazyTrain trains the parameters it found then, and a new one would not be "
        f"updated: change the model before lazytrain.initialize, or after engine.destroy(), which hands it back")


def _refuse_resize(*args, **kwargs):
    raise ModelChangedError(
        "resize_token_embeddings after lazytrain.initialize: the engine laid its fp32 masters, gradients and "
        "optimizer state out for the embedding and head it was given, and resized ones would train outside them "
        "(a resized head would never be updated). Resize before lazytrain.initialize (with a Trainer: before "
        "building it), or call engine.destroy() and initialize again")
