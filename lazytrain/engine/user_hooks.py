"""Hooks of the user's that a streamed block cannot honour as plain PyTorch does, found so that the engine can
say so: a streamed block's training forward runs without autograd and its backward runs it again, and it
computes from streamed copies of its weights, so

- a forward hook (or pre-hook) on a module inside a block, or a global module hook, sees tensors that carry
  no gradient, and runs twice per training forward (hooks on the block itself run once, on outputs that do);
- a hook on a block's parameter (``register_hook``, ``register_post_accumulate_grad_hook``) never runs: the
  gradients go to host buffers, not through the parameter."""
from __future__ import annotations

import torch.nn as nn
from torch.nn.modules import module as _module


# modules whose hooks are not the user's: transformers' output capturing installs inactive hooks the first
# time hidden states or attentions are asked for (engine.py warns of attentions asked for in training)
_LIBRARY_HOOKS = ("transformers.utils.output_capturing",)


def _users(hooks) -> bool:
    """Whether ``hooks`` (a module's hook dict) holds one that is not a library's own."""
    return any(getattr(h, "__module__", None) not in _LIBRARY_HOOKS for h in hooks.values())


def _named(blocks: nn.ModuleList, blocks_path: str):
    for i, block in enumerate(blocks):
        yield f"{blocks_path}.{i}" if blocks_path else str(i), block


def hooked_submodules(blocks: nn.ModuleList, blocks_path: str) -> list[str]:
    """The modules inside the blocks (not the blocks themselves) with forward hooks or pre-hooks, by name;
    every one of them where a global module forward hook is set (named as such first)."""
    names = []
    if _users(_module._global_forward_hooks) or _users(_module._global_forward_pre_hooks):
        names.append("every module (a global hook: torch.nn.modules.module.register_module_forward_hook)")
    for prefix, block in _named(blocks, blocks_path):
        for name, sub in block.named_modules(prefix=prefix):
            if sub is not block and (_users(sub._forward_hooks) or _users(sub._forward_pre_hooks)):
                names.append(name)
    return names


def hooked_parameters(blocks: nn.ModuleList, blocks_path: str) -> list[str]:
    """The blocks' parameters with gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    names = []
    for prefix, block in _named(blocks, blocks_path):
        for name, p in block.named_parameters(prefix=prefix):
            if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
                names.append(name)
    return names


def _listed(names: list[str]) -> str:
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def submodule_hooks_warning(names: list[str]) -> str:
    return (f"lazytrain: forward hook(s) on {_listed(names)}, inside a streamed block: the training forward of a "
            f"block the backward re-runs runs without autograd, so a tensor such a hook keeps carries no gradient (a "
            f"loss term built from it trains nothing, and tensor.register_hook on it fails), and the backward runs "
            f"the block again, calling the hook a second time; in a block whose graph the forward records, a loss "
            f"term built from it is refused at the backward (under retain_graph=True it trains nothing). A hook on "
            f"the block itself runs once, on outputs that carry gradient")


def parameter_hooks_warning(names: list[str]) -> str:
    return (f"lazytrain: gradient hook(s) on {_listed(names)}, a parameter of a streamed block, do not run: the "
            f"block computes from streamed copies of its weights, and its gradients go to host buffers, not "
            f"through the parameter. Read or change a gradient between engine.backward() and engine.step() "
            f"with lazytrain.utils.safe_get_full_grad / safe_set_full_grad")
