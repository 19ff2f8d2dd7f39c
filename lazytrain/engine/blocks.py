"""Find the model's repeated blocks: the layers that LazyTrain streams.

In order: a dotted path named in config ("transformer.h"); the Hugging Face causal-LM layouts
(``model.model.layers``, ``transformer.h``, ...); else the largest ``nn.ModuleList`` of structurally
identical modules. The blocks of a named or Hugging Face list may differ from one another (DeepSeek-V3's
dense first layers before its mixture-of-experts ones, Gemma's sliding and global attention layers):
each layer streams with its own layout. Only the search among unnamed lists asks for identical modules,
so that it does not pick, say, a list of parallel heads over the decoder stack.
"""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager

import torch.nn as nn

from ..config import ConfigError


class BlockDiscoveryError(ValueError):
    pass


def _structure(module: nn.Module) -> tuple:
    """A module's shape signature: class, and every parameter's name, shape and dtype; a compiled module's
    those of the module it wraps (so that a list with one block compiled is still found, and refused)."""
    if is_compiled(module):
        module = getattr(module, "_orig_mod", module)
    return (type(module).__name__,
            tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def _resolve(model: nn.Module, path: str) -> nn.Module:
    obj = model
    for part in path.split("."):
        if not hasattr(obj, part):
            # a wrapper's path to the same blocks (PEFT's PeftModel puts the model under base_model.model)
            wrapped = [name for name, m in model.named_modules() if name.endswith("." + path)
                       and isinstance(m, (nn.ModuleList, nn.Sequential))]
            raise BlockDiscoveryError(f"config 'lazytrain.blocks' is {path!r}, but the model has no attribute "
                                      f"{part!r} along that path"
                                      + (f"; the model wraps them: did you mean {wrapped[0]!r}?" if wrapped else ""))
        obj = getattr(obj, part)
    return obj


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    """Return (dotted path, ModuleList) of the blocks to stream."""
    if path:
        blocks = _resolve(model, path)
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise BlockDiscoveryError(f"config 'lazytrain.blocks' {path!r} is a {type(blocks).__name__}, "
                                      f"not an nn.ModuleList")
        _check_blocks(blocks, path)
        return path, blocks
    # Hugging Face's layouts: decoders, then the language model of a vision-language model (transformers 5:
    # Gemma 3/4, Qwen2/3.5-VL, LLaVA under model.language_model; Llama 4 under language_model.model), whose
    # vision tower's identical blocks the search below would otherwise take where the text layers differ
    for candidate in ("model.layers", "model.model.layers", "transformer.h", "model.decoder.layers",
                      "model.language_model.layers", "language_model.model.layers", "language_model.layers",
                      "layers"):
        try:
            blocks = _resolve(model, candidate)
        except BlockDiscoveryError:
            continue
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            try:
                _check_blocks(blocks, candidate)
            except BlockDiscoveryError:
                continue
            _warn_if_larger_elsewhere(model, candidate, blocks)
            return candidate, blocks
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            sigs = {_structure(m) for m in module}
            if len(sigs) != 1 or not any(True for _ in module[0].parameters()):
                continue
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > sum(p.numel() for p in best[1].parameters()):
                best = (name, module)
    if best is None:   # nothing repeats (a CNN): every parameter stays on the device, nothing streams
        lists = [(sum(p.numel() for p in m.parameters()), name, len(m)) for name, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) > 1]
        n, name, count = max(lists, default=(0, None, 0))
        hint = (f"The largest list of several modules, {name!r} ({count} modules, {n:,} parameters), holds "
                f"modules that differ in structure (T5's first block keeps the position bias), which the search "
                f"does not take: to stream it, name it: \"lazytrain\": {{\"blocks\": \"{name}\"}}") if n else \
            "If it has blocks, name them: \"lazytrain\": {\"blocks\": \"path.to.layers\"}"
        warnings.warn("lazytrain: the model has no repeated blocks (no nn.ModuleList of structurally identical "
                      "modules with parameters), so nothing streams: every parameter stays on the compute device. "
                      + hint, UserWarning, stacklevel=4)
        return "", nn.ModuleList()
    _warn_if_larger_elsewhere(model, *best)
    return best


def _warn_if_larger_elsewhere(model: nn.Module, path: str, blocks: nn.ModuleList) -> None:
    """Said when another list of several modules outside the chosen one holds more parameters (an encoder
    beside a decoder, a vision tower, a list merely named ``layers``): those stay on the device, and the
    user may have meant them."""
    chosen = sum(p.numel() for p in blocks.parameters())
    larger = [(name, n) for name, module in model.named_modules()
              if isinstance(module, nn.ModuleList) and len(module) > 1 and name != path
              and not name.startswith(path + ".") and not path.startswith(name + ".")
              and (n := sum(p.numel() for p in module.parameters())) > chosen]
    if larger:
        name, n = max(larger, key=lambda item: item[1])
        warnings.warn(f"lazytrain: the streamed blocks are {path!r} ({len(blocks)} blocks, {chosen:,} parameters), "
                      f"and {name!r} holds more ({n:,}), which stays on the compute device: if those are the "
                      f"blocks to stream, name them: \"lazytrain\": {{\"blocks\": \"{name}\"}}",
                      UserWarning, stacklevel=4)


def _check_blocks(blocks, path: str) -> None:
    if len(blocks) == 0:
        raise BlockDiscoveryError(f"block list {path!r} is empty")
    if not any(True for _ in blocks.parameters()):
        raise BlockDiscoveryError(f"the blocks at {path!r} have no parameters: there is nothing to stream")


def turn_off_layer_checkpointing(model: nn.Module, path: str, blocks: nn.ModuleList) -> list[nn.Module]:
    """Turn Hugging Face gradient checkpointing off for the streamed blocks; returns the modules changed.

    The executor already re-runs each block in backward as its plan says. Checkpointing the blocks again
    (transformers 5 wraps each layer's ``forward``; 4.x wraps the layer call in the decoder's loop) would
    re-run them a second time, and the reentrant variant cannot be differentiated the way the executor
    differentiates a block (``torch.autograd.grad``)."""
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    changed = [m for m in (parent, *blocks) if getattr(m, "gradient_checkpointing", None) is True]
    for m in changed:
        m.gradient_checkpointing = False
    if changed:
        warnings.warn("lazytrain: the model's gradient checkpointing is off for the streamed blocks while LazyTrain "
                      "trains them: LazyTrain re-runs them in backward itself, as its plan says (the "
                      "activation_checkpointing / lazytrain.checkpoint_interval settings)")
    return changed


def check_no_shared_weights(model: nn.Module, path: str, blocks: nn.ModuleList) -> None:
    """Each streamed layer keeps its weights in its own flat buffers (master, compute copy, gradient), so
    a parameter cannot belong to two blocks, or to a block and a module outside them: one of the two
    would train a stale copy. Refused, naming both places, rather than trained wrong."""
    owner: dict[int, tuple[int, str]] = {}
    for i, block in enumerate(blocks):
        names: dict[int, str] = {}
        for name, p in block.named_parameters(remove_duplicate=False):   # tied within the block
            if id(p) in names and p.requires_grad:
                raise BlockDiscoveryError(
                    f"block {i}'s parameters {names[id(p)]!r} and {name!r} are one tied weight: LazyTrain computes a "
                    f"block on views of its weights by name, and a tie within a block would train one of the two "
                    f"uses on a stale copy. Untie it, or name another block list in 'lazytrain.blocks'")
            names.setdefault(id(p), name)
        for name, p in block.named_parameters():
            if id(p) in owner and p.requires_grad:   # a frozen copy in each block's buffers cannot go stale
                j, other = owner[id(p)]
                raise BlockDiscoveryError(
                    f"block {i}'s parameter {name!r} is also block {j}'s {other!r}: LazyTrain streams each block's "
                    f"weights from that block's own buffers, so blocks cannot share a weight. Untie it, or name "
                    f"another block list in 'lazytrain.blocks'")
            owner[id(p)] = (i, name)
    inside = {id(m) for m in blocks.modules()}
    for module_name, module in model.named_modules():
        if id(module) in inside:      # the blocks, under whatever name (a second handle to the list too)
            continue
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owner and p.requires_grad:
                i, inner = owner[id(p)]
                name = f"{module_name}.{pname}" if module_name else pname
                raise BlockDiscoveryError(
                    f"the model's parameter {name!r} is block {i}'s {inner!r}: LazyTrain streams each block's "
                    f"weights from that block's own buffers, so a weight cannot be both in a block and outside "
                    f"the blocks. Untie it, or name another block list in 'lazytrain.blocks'")


def is_compiled(module: nn.Module) -> bool:
    """``torch.compile(module)`` (a wrapper) or ``module.compile()`` (in place). Dynamo is not imported to
    find out (seconds per process): a module compiled in this process has imported it already."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def compiled_error(where: str) -> ConfigError:
    return ConfigError(f"{where} is compiled with torch.compile: pass lazytrain.initialize the module before "
                       f"compiling it. LazyTrain routes every streamed block through its executor, which "
                       f"torch.compile cannot trace")


def refuse_compiled_blocks(model: nn.Module, path: str, blocks: nn.ModuleList) -> None:
    """A compiled block, a compiled module inside one, or a compiled module that calls the blocks (one
    on the path to them) would trace the executor; modules elsewhere (a compiled head) may stay compiled."""
    parts = path.split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k])
        if is_compiled(model.get_submodule(prefix)):
            raise compiled_error(f"submodule {prefix!r}")
    for name, module in blocks.named_modules():
        if is_compiled(module):
            raise compiled_error(f"submodule {path + '.' + name if name else path!r}")


def is_quantized(t) -> bool:
    """Quantized weights: integer storage (bitsandbytes' 4-bit and 8-bit layers, packed GPTQ/AWQ values) or an
    8-bit float (FP8 checkpoints): values that mean something only beside their scales, in their own dtype."""
    return not t.is_floating_point() or t.element_size() == 1


def refuse_quantized_block_weights(path: str, blocks: nn.ModuleList) -> None:
    """The streamed layers keep their weights in flat buffers of the training precision: a quantized weight
    cast into one would lose its dtype (and the bitsandbytes ``quant_state`` its forward reads), so a
    quantized model would crash inside its kernels or compute on wrong values. Refused before anything moves,
    naming the parameter."""
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if p.is_complex():
                raise ConfigError(f"block parameter {path}.{i}.{name} is {str(p.dtype).replace('torch.', '')}: "
                                  f"LazyTrain streams the blocks' weights in the training precision, which has no "
                                  f"imaginary part; keep complex tensors in buffers, or outside the blocks")
            if is_quantized(p):
                kind = type(p).__name__
                raise ConfigError(
                    f"block parameter {path}.{i}.{name} is quantized ({str(p.dtype).replace('torch.', '')}"
                    f"{'' if kind == 'Parameter' else ', ' + kind}): LazyTrain streams the blocks' weights in the "
                    f"training precision and cannot stream quantized weights (bitsandbytes 4-bit/8-bit layers, "
                    f"GPTQ/AWQ, FP8). Load the model unquantized in bf16: a frozen weight then costs 2 host bytes a "
                    f"parameter (a LoRA run's base model, README), or train the quantized model without LazyTrain")


# PEFT's tuner layers' switch (``model.disable_adapter()`` sets it on every LoRA layer): a forward run under it,
# re-run after it, must run without the adapters again
_ADAPTERS_OFF = "_disable_adapters"


def train_modes(module: nn.Module) -> tuple:
    """The train/eval flag of each of ``module.modules()``, in that order, with the adapters' off switch of
    each that has one (PEFT's tuner layers): ``(training, adapters_off)``, ``adapters_off`` None elsewhere."""
    return tuple((m.training, m.__dict__.get(_ADAPTERS_OFF)) for m in module.modules())


@contextmanager
def in_modes(module: nn.Module, modes: tuple):
    """``module``'s modules in the train/eval ``modes`` :func:`train_modes` took (a forward's, for its re-run
    or recomputation: dropout on or off as it was, whatever the model's mode is by backward; the adapters on or
    off as they were, whatever ``disable_adapter()`` says by then), put back after; nothing changed where the
    module's modules changed since."""
    modules = list(module.modules())
    if len(modules) != len(modes):
        yield
        return
    now = train_modes(module)
    try:
        _set_modes(modules, modes)
        yield
    finally:
        _set_modes(modules, now)


def _set_modes(modules: list[nn.Module], modes: tuple) -> None:
    for m, (training, adapters_off) in zip(modules, modes):
        m.training = training
        if adapters_off is not None and _ADAPTERS_OFF in m.__dict__:
            m.__dict__[_ADAPTERS_OFF] = adapters_off
