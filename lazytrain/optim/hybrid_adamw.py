"""HybridAdamW: AdamW with blockwise 8-bit moments for large tensors and fp32 moments for the rest.

Memory: a tensor with 8-bit states keeps two uint8 codes per element plus two fp32 absmax values per
block (2 + 8 / block_size bytes per parameter, 2.031 at the default block size of 256) instead of fp32 Adam's 8.
The fp32 master weights are the parameters themselves.

Which tensors get 8-bit states (reported by :meth:`HybridAdamW.state_report`):

* the group's ``optimizer_states`` is ``"8bit"`` (``"fp32"`` turns it off), and
* ``numel >= min_8bit_size``, and
* if the tensor's name is known (pass ``model.named_parameters()`` as ``params`` or as
  ``named_parameters``): the name matches none of ``fp32_name_patterns`` (regular expressions searched
  case-insensitively; the defaults catch norms and biases); if the name is unknown: the tensor has at
  least 2 dimensions (biases and norm scales are 1-D).

One step per tensor is a single fused pass (C++ on the host, see ``kernels/hybrid_adam.cpp``): per block,
dequantize both moments, apply the Adam(W) update with the clip coefficient, lr, weight decay and bias
correction, write the fp32 weight and optionally its bf16/fp16 compute copy, requantize. CUDA tensors
use bitsandbytes' fused 8-bit kernel when it is installed (block size 256, AdamW mode); everything else
(no compiler, other devices) runs the same arithmetic with torch operations.

Clipping and non-finite gradients: with ``max_grad_norm > 0`` the global gradient norm is computed as
``torch.nn.utils.clip_grad_norm_`` does and the coefficient is applied inside the update. A non-finite
norm skips the whole step (no parameter or state changes) and is counted in ``skipped_steps`` and
``last_step_skipped``. An engine that already has the norm passes ``grad_norm=`` (or ``clip_coef=``).

Streaming engine use (per-layer norms during backward, update layer by layer, bf16 copy in the same pass)::

    norms += clipping.tensor_norms(layer_grads)        # in backward, while the gradients are hot
    total, finite = clipping.combine_norms(norms)      # == clip_grad_norm_'s total for fp32 grads
    if not finite:
        opt.record_skipped_step(float(total))          # nothing is updated
    else:                                              # clip coefficient from total and max_grad_norm
        for params, copies in layers:                  # a layer is final as soon as its call returns
            opt.step(params=params, grad_norm=total, compute_copies=copies)  # copies: {param: bf16 tensor}
"""
from __future__ import annotations

import collections
import logging
import math
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from . import clipping
from .kernels import cpu_kernels, make_hyper
from .quantization import QuantMap, encode, get_qmap, num_blocks

__all__ = ["HybridAdamW", "DEFAULT_BLOCK_SIZE", "DEFAULT_FP32_PATTERNS"]

log = logging.getLogger(__name__)

#: Chosen by measurement (BENCHMARKS.md, host optimizer): step time is flat from 256 to 4096 on the host
#: kernel, and 256 gives the smallest quantization error and the bitsandbytes CUDA kernel's block size.
DEFAULT_BLOCK_SIZE = 256
#: Names kept in fp32 states: normalisation layers and biases.
DEFAULT_FP32_PATTERNS: Tuple[str, ...] = (r"norm", r"bias", r"(^|[._])ln(_|\d|\.|$)")

_STATE_KINDS = ("8bit", "fp32")
#: the group settings that say which states a tensor gets: the optimizer's own, whatever a checkpoint says
_LAYOUT_KEYS = ("optimizer_states", "min_8bit_size", "block_size")


class PostHookTable(collections.OrderedDict):
    """The optimizer's step post-hooks: torch's own table, which ``register_step_post_hook`` and a handle's
    ``remove()`` change as ever, but which torch's step wrapper finds empty while ``held``. Why: an engine that
    updates the streamed layers after ``step()`` returns (``lazytrain.overlap_optimizer``) holds the hooks back
    for that step and runs them once every layer is updated (:meth:`HybridAdamW.run_held_post_hooks`): an EMA or
    a logger read the layers' weights of the step before. torch's global post-hooks are not held: they run inside
    the step."""
    held = False

    def values(self):
        return iter(()) if self.held else super().values()

    def held_values(self):
        return collections.OrderedDict.values(self)


def refuse_unordered(params, group: bool = False) -> None:
    """Parameters in a set, anywhere (torch refuses one inside a group only, and accepts one in place of the
    list): a set's order changes between runs, and a checkpoint pairs state with parameters by their order, so
    a resume gave same-shaped parameters each other's moments. A bare tensor in place of the list (torch's
    check, which listing it first passed) was listed row by row."""
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    if not group and isinstance(params, torch.Tensor):
        raise TypeError(f"params argument given to the optimizer should be an iterable of Tensors or dicts, but "
                        f"got {torch.typename(params)}")


def _split_named(params) -> Tuple[list, Dict[int, str]]:
    """Accept tensors, (name, tensor) pairs or param-group dicts; return torch-style groups and names."""
    names: Dict[int, str] = {}
    refuse_unordered(params)
    params = list(params)
    if not params:
        raise ValueError("HybridAdamW got an empty parameter list")

    def strip(seq):
        out = []
        for item in seq:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                names[id(item[1])] = item[0]
                out.append(item[1])
            else:
                out.append(item)
        return out

    if isinstance(params[0], dict):
        groups = []
        for g in params:
            g = dict(g)
            ps = g["params"]
            refuse_unordered(ps, group=True)
            g["params"] = strip([ps] if isinstance(ps, torch.Tensor) else list(ps))
            groups.append(g)
        return groups, names
    return strip(params), names


def choose_states(p: torch.Tensor, name: Optional[str], optimizer_states: str, min_8bit_size: int,
                  fp32_res: Sequence["re.Pattern"]) -> Tuple[str, str]:
    """(kind, reason): whether ``p`` (named ``name``, or None) gets "8bit" or "fp32" Adam states under these rules
    (what :class:`HybridAdamW` does; the engine tells its planner the share that will)."""
    if optimizer_states == "fp32":
        return "fp32", "optimizer_states=fp32"
    if p.numel() < min_8bit_size:
        return "fp32", f"numel < min_8bit_size ({min_8bit_size})"
    if name is not None:
        for rx in fp32_res:
            if rx.search(name):
                return "fp32", f"name matches {rx.pattern!r}"
    elif p.dim() < 2:
        return "fp32", "1-D tensor without a name (bias or norm)"
    return "8bit", f"numel >= {min_8bit_size}"


class HybridAdamW(torch.optim.Optimizer):
    """AdamW (``adamw_mode=True``) or Adam with L2 (``adamw_mode=False``) with hybrid 8-bit/fp32 states.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or param-group dicts.
            Per-group keys: ``lr, betas, eps, weight_decay, adamw_mode, optimizer_states, min_8bit_size,
            block_size``.
        optimizer_states: ``"8bit"`` (hybrid, default) or ``"fp32"`` (all states fp32).
        min_8bit_size: tensors with fewer elements keep fp32 states.
        block_size: elements per absmax block (multiple of 32, at most 16384).
        fp32_name_patterns: regular expressions; a parameter whose name matches keeps fp32 states
            (``None``: the defaults, norms and biases).
        named_parameters: names for parameters passed as plain tensors: ``(name, tensor)`` pairs (e.g.
            ``model.named_parameters()``) or a mapping ``{id(param): name}``.
        max_grad_norm: clip the global gradient norm to this value (0 disables clipping).
        check_finite: when no norm is supplied, compute it anyway to detect non-finite gradients.
        compute_copies: ``{param: tensor}``; the update writes each param's value into its tensor
            (bf16 or fp16, same shape) in the same pass. Can be extended per step.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, adamw_mode: bool = True, optimizer_states: str = "8bit",
                 min_8bit_size: int = 4096, block_size: int = DEFAULT_BLOCK_SIZE,
                 fp32_name_patterns: Optional[Sequence[str]] = DEFAULT_FP32_PATTERNS,
                 named_parameters=None, max_grad_norm: float = 0.0,
                 check_finite: bool = True, compute_copies: Optional[Mapping[torch.Tensor, torch.Tensor]] = None):
        _check_hyperparameters(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if not max_grad_norm >= 0.0:   # written so that NaN fails too
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        _check_kind(optimizer_states)
        _check_block(block_size)
        groups, names = _split_named(params)
        if named_parameters is not None:
            items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
            for a, b in items:
                if isinstance(a, int) and isinstance(b, str):  # {id(param): name}
                    names.setdefault(a, b)
                elif isinstance(a, str) and isinstance(b, torch.Tensor):  # (name, param)
                    names.setdefault(id(b), a)
                else:
                    raise TypeError("named_parameters must hold (name, tensor) pairs or map id(param) -> name")
        if fp32_name_patterns is None:
            fp32_name_patterns = DEFAULT_FP32_PATTERNS
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=bool(adamw_mode),
                        optimizer_states=optimizer_states, min_8bit_size=int(min_8bit_size),
                        block_size=int(block_size))
        super().__init__(groups, defaults)   # each group is checked as it joins (add_param_group)
        self._optimizer_step_post_hooks = PostHookTable(self._optimizer_step_post_hooks)
        self._names = names
        self.fp32_name_patterns = tuple(fp32_name_patterns)
        self._fp32_re = [re.compile(pat, re.IGNORECASE) for pat in self.fp32_name_patterns]
        self.max_grad_norm = float(max_grad_norm)
        self.check_finite = bool(check_finite)
        self.compute_copies: Dict[torch.Tensor, torch.Tensor] = {}
        if compute_copies:
            self.set_compute_copies(compute_copies)
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_grad_norm: Optional[float] = None
        self.groups_of_last_step: List[Dict[str, Any]] = []   # snapshot() as the last step() ran its groups
        self.last_clip_coef = 1.0
        self._reported = False

    # ------------------------------------------------------------------ selection and report
    def param_name(self, p: torch.Tensor) -> Optional[str]:
        return self._names.get(id(p))

    def name_parameters(self, names: Mapping[int, str]) -> None:
        """Names (``id(param) -> name``) for parameters this optimizer was given without one: a caller that
        re-points it at other tensors (an engine's fp32 masters) names them, so that ``fp32_name_patterns``
        still choose their states. A name already known is kept."""
        for key, name in names.items():
            self._names.setdefault(key, name)

    def _choose(self, p: torch.Tensor, group: Dict[str, Any]) -> Tuple[str, str]:
        """(kind, reason) for a parameter under the current rules."""
        return choose_states(p, self.param_name(p), group["optimizer_states"], group["min_8bit_size"], self._fp32_re)


    def state_report(self) -> List[Dict[str, Any]]:
        """One entry per parameter: name, shape, numel, states ("8bit"/"fp32"), reason, state bytes."""
        rows = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                st = self.state.get(p)
                kind, reason = self._choose(p, group)
                if st and _kind_of(st) != kind:
                    kind, reason = _kind_of(st), "restored from checkpoint"
                bs = st.get("block_size", group["block_size"]) if st else group["block_size"]
                nbytes = _state_bytes(kind, p.numel(), bs)
                rows.append(dict(name=self.param_name(p) or f"group{gi}.param{pi}", shape=tuple(p.shape),
                                 numel=p.numel(), states=kind, reason=reason, state_bytes=nbytes))
        return rows

    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments and absmax) for all parameters, allocated or not."""
        return sum(r["state_bytes"] for r in self.state_report())

    def format_state_report(self) -> str:
        rows = self.state_report()
        n8 = sum(r["numel"] for r in rows if r["states"] == "8bit")
        n32 = sum(r["numel"] for r in rows if r["states"] == "fp32")
        total = n8 + n32
        nbytes = sum(r["state_bytes"] for r in rows)
        lines = [f"HybridAdamW: {sum(r['states'] == '8bit' for r in rows)} tensors / {n8:,} params with 8-bit "
                 f"states, {sum(r['states'] == 'fp32' for r in rows)} tensors / {n32:,} params with fp32 states; "
                 f"{nbytes / max(total, 1):.3f} bytes of state per parameter"]
        for r in rows:
            lines.append(f"  {r['states']:>4}  {r['name']}  {list(r['shape'])}  ({r['reason']})")
        return "\n".join(lines)

    def set_compute_copies(self, mapping: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Register tensors that receive each parameter's new value (in their dtype) during the update."""
        for p, c in mapping.items():
            if c.shape != p.shape:
                raise ValueError(f"compute copy for {self.param_name(p) or tuple(p.shape)} has shape "
                                 f"{tuple(c.shape)}, expected {tuple(p.shape)}")
            self.compute_copies[p] = c

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        kind, _ = self._choose(p, group)
        st = self.state[p]
        st["step"] = 0
        if kind == "8bit":
            bs = group["block_size"]
            q1, q2 = get_qmap("dynamic", p.device), get_qmap("udynamic", p.device)
            nb = num_blocks(p.numel(), bs)
            st["block_size"] = bs
            st["state1"] = torch.full(p.shape, q1.zero_code, dtype=torch.uint8, device=p.device)
            st["state2"] = torch.full(p.shape, q2.zero_code, dtype=torch.uint8, device=p.device)
            st["absmax1"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
            st["absmax2"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        else:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if not self._reported:
            self._reported = True
            log.info("%s", self.format_state_report())
        return st

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if isinstance(param_group, dict):   # checked before it joins (torch reports other malformations)
            params = param_group.get("params", [])
            refuse_unordered(params, group=True)
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            named = [x for x in params if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)]
            if named:   # (name, tensor) pairs, as the constructor takes them
                self.name_parameters({id(t): n for n, t in named})
                params = [x[1] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else x
                          for x in params]
            param_group["params"] = params      # a generator is read once (torch lists it the same way)
            _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def torch_state_dict(self) -> Dict[str, Any]:
        """This optimizer's state as ``torch.optim.AdamW.state_dict()`` holds it, for a script going back to
        torch's AdamW: fp32 ``exp_avg``/``exp_avg_sq`` (8-bit ones dequantized) and ``step`` as a tensor.
        torch's ``load_state_dict`` takes :meth:`state_dict`'s 8-bit codes without a word, as fp32 numbers,
        and fails at its first step."""
        sd = self.state_dict()
        by_id = {i: p for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        q1, q2 = get_qmap("dynamic", "cpu"), get_qmap("udynamic", "cpu")
        state = {}
        for index, st in sd["state"].items():
            kind = _kind_of(st)
            if kind is None:
                continue
            shape = by_id[index].shape
            if kind == "8bit":
                bs = int(st["block_size"])
                moments = {key: _dequantized(st["state" + which].reshape(-1).cpu(), st["absmax" + which].cpu(),
                                             qmap, bs).view(shape)
                           for key, which, qmap in (("exp_avg", "1", q1), ("exp_avg_sq", "2", q2))}
            else:
                moments = {key: st[key].detach().clone() for key in ("exp_avg", "exp_avg_sq")}
            state[index] = {"step": torch.tensor(float(st["step"])), **moments}
        # torch's group keys, AdamW's or Adam's decay as this group steps (loaded into torch.optim.Adam too)
        groups = [{"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                   "fused": None, **g, "decoupled_weight_decay": bool(g.get("adamw_mode", True))}
                  for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint; quantized states keep their uint8 codes, fp32 absmax and block size. Moments
        of the other kind than this optimizer gives the parameter (fp32 ones from torch's AdamW, DeepSpeed or
        an ``optimizer_states="fp32"`` run; 8-bit ones into fp32 states) are converted to its kind, so
        that the configured state precision holds after a resume (see :meth:`_into_kind`): the groups'
        layout settings (``optimizer_states``, ``min_8bit_size``, ``block_size``) stay this optimizer's, the
        checkpoint's other settings (lr, betas, ...) are loaded."""
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        for group in saved_groups:        # refused before anything is loaded
            _check_flags(group, "the checkpoint's parameter group")
        layouts = [{k: g[k] for k in _LAYOUT_KEYS if k in g} for g in self.param_groups]
        before = {"state": self.state, "param_groups": self.param_groups}   # torch's load replaces both
        try:
            self._load_checked(state_dict, saved_state, saved_groups, layouts)
        except BaseException:
            # a refused checkpoint leaves this optimizer as it was: half its groups' settings and a moment of
            # another parameter's size would reach the update kernel, which trusts the sizes
            self.__setstate__(before)
            raise

    def _load_checked(self, state_dict: Dict[str, Any], saved_state: Dict, saved_groups: list,
                      layouts: list) -> None:
        # the groups through torch's load, the states built below from the checkpoint's: torch's load would cast
        # every state tensor to its parameter's dtype first (the 8-bit codes to fp32, 4x their bytes at once)
        super().load_state_dict({**state_dict, "state": {}})
        for group, layout in zip(self.param_groups, layouts):
            group.update(layout)
            for key, value in self.defaults.items():   # a checkpoint from torch's Adam(W) lacks HybridAdamW's keys
                group.setdefault(key, value)
            _check_group(group)
        saved_ids = [i for g in saved_groups for i in g["params"]]
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for idx, (p, group) in zip(saved_ids, params):
            if idx not in saved_state:
                continue
            src = saved_state[idx]
            st = self.state[p]
            kind = _kind_of(src)
            if kind is None:
                raise ValueError(f"checkpoint state of parameter {idx} holds neither 8-bit (state1/state2) nor "
                                 f"fp32 (exp_avg/exp_avg_sq) moments (keys {sorted(src)}); was it saved by HybridAdamW?")
            if kind == "8bit":
                bs = int(src["block_size"])
                try:
                    _check_block(bs)   # the kernel holds a block's moments in buffers of the largest size
                except ValueError as e:
                    raise ValueError(f"checkpoint state of parameter {idx}: {e}") from None
                st["block_size"] = bs
                nb = num_blocks(p.numel(), bs)
                for key in ("state1", "state2"):
                    t = src[key]
                    if t.dtype != torch.uint8 or t.numel() != p.numel():
                        raise ValueError(f"checkpoint {key} of parameter {idx} does not match its shape "
                                         f"{tuple(p.shape)} (got {t.dtype} {tuple(t.shape)})")
                    st[key] = _contiguous_copy(t, p, torch.uint8)
                for key in ("absmax1", "absmax2"):
                    t = src[key]
                    if t.numel() != nb:
                        raise ValueError(f"checkpoint {key} of parameter {idx} has {t.numel()} blocks, "
                                         f"expected {nb} for block_size {bs}")
                    st[key] = t.to(device=p.device, dtype=torch.float32, copy=True)
            else:
                for key in ("exp_avg", "exp_avg_sq"):
                    t = src[key]
                    if t.numel() != p.numel():
                        raise ValueError(f"checkpoint {key} of parameter {idx} does not match its shape")
                    # a torch Adam(W) state may have a transposed layout (zeros_like of a strided
                    # parameter); the kernel reads state memory as contiguous
                    st[key] = _contiguous_copy(t, p, torch.float32)
            st["step"] = int(src["step"])
            self._into_kind(p, st, group)

    def _into_kind(self, p: torch.Tensor, st: Dict[str, Any], group: Mapping[str, Any]) -> None:
        """``st`` (a loaded state) in the kind :meth:`_choose` gives ``p``, laid out as :meth:`_init_state`
        makes it: fp32 moments quantized blockwise at the group's block size (:func:`_fitted`), 8-bit ones
        dequantized to fp32. Without it a resume from fp32 moments would
        keep 8 bytes per parameter for good where 8-bit states were asked for (or the reverse)."""
        kind, _ = self._choose(p, group)
        if _kind_of(st) == kind:
            return
        q1, q2 = get_qmap("dynamic", p.device), get_qmap("udynamic", p.device)
        if kind == "8bit":
            bs = group["block_size"]
            st["state1"], st["absmax1"] = _quantized(st.pop("exp_avg").reshape(-1), q1, bs)
            st["state2"], st["absmax2"] = _quantized(st.pop("exp_avg_sq").reshape(-1), q2, bs)
            st["state1"], st["state2"] = st["state1"].view(p.shape), st["state2"].view(p.shape)
            st["block_size"] = bs
        else:
            bs = int(st.pop("block_size"))
            for key, which, qmap in (("exp_avg", "1", q1), ("exp_avg_sq", "2", q2)):
                codes, absmax = st.pop("state" + which), st.pop("absmax" + which)
                st[key] = _dequantized(codes.reshape(-1), absmax, qmap, bs).view(p.shape)

    def fp32_moment_chunks(self, p: torch.Tensor, key: str, max_elems: int = 1 << 24):
        """``p``'s moment ``key`` ("exp_avg" or "exp_avg_sq") in fp32, flat, as host tensors of at most
        ``max_elems`` elements (8-bit moments dequantized a few blocks at a time, never whole)."""
        st = self.state[p]
        if _kind_of(st) == "fp32":
            flat = st[key].reshape(-1)
            for start in range(0, flat.numel(), max_elems):
                yield flat[start:start + max_elems].to("cpu", torch.float32)
            return
        which = "1" if key == "exp_avg" else "2"
        qmap = get_qmap("dynamic" if which == "1" else "udynamic", st["state" + which].device)
        for part in _dequant_chunks(st["state" + which], st["absmax" + which], qmap, int(st["block_size"]),
                                    max_elems):
            yield part.cpu()

    def set_fp32_moment(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """Write ``p``'s moment ``key`` ("exp_avg" or "exp_avg_sq") from the fp32 ``value`` of ``p``'s shape:
        8-bit moments quantized blockwise (:func:`_fitted`: what :meth:`fp32_moment_chunks` reads back, to
        the 8-bit codes' precision; a value read so and written back keeps its codes)."""
        st = self.state[p]
        if _kind_of(st) == "fp32":
            st[key].copy_(value)
            return
        which = "1" if key == "exp_avg" else "2"
        qmap = get_qmap("dynamic" if which == "1" else "udynamic", st["state" + which].device)
        codes, absmax = _quantized(value.reshape(-1), qmap, int(st["block_size"]))
        st["state" + which].copy_(codes.view(p.shape))
        st["absmax" + which].copy_(absmax)

    # ------------------------------------------------------------------ step
    def record_skipped_step(self, grad_norm: Optional[float] = None) -> None:
        """Count a step skipped because of non-finite gradients (also called by :meth:`step`)."""
        self.skipped_steps += 1
        self.last_step_skipped = True
        self.last_grad_norm = None if grad_norm is None else float(grad_norm)
        log.warning("HybridAdamW: non-finite gradient norm or clip coefficient (norm %s); step skipped (%d skipped "
                    "so far)", grad_norm, self.skipped_steps)

    @torch.no_grad()
    def step(self, closure=None, *, grad_norm=None, clip_coef=None, params: Optional[Iterable[torch.Tensor]] = None,
             compute_copies: Optional[Mapping[torch.Tensor, torch.Tensor]] = None):
        """One optimizer step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            grad_norm: global gradient norm computed by the caller (e.g. from per-layer norms with
                :func:`lazytrain.optim.clipping.combine_norms`); non-finite skips the step; with
                ``max_grad_norm > 0`` the clip coefficient is derived from it.
            clip_coef: the clip coefficient to apply (overrides the one derived from the norm).
            params: update only these parameters (e.g. one streamed layer). With clipping, pass the
                global ``grad_norm`` or ``clip_coef``: a subset cannot know the global norm.
            compute_copies: extra ``{param: bf16/fp16 tensor}`` written in the same pass for this step.
        Returns the closure's loss (or ``None``). Check ``last_step_skipped`` for skipped steps.
        """
        loss = None
        # what torch's step wrapper hands the post-hooks, for :meth:`run_held_post_hooks` (pre-hooks may change it)
        self._last_step_call = ((self,) if closure is None else (self, closure),
                                {k: v for k, v in (("grad_norm", grad_norm), ("clip_coef", clip_coef), ("params", params),
                                                   ("compute_copies", compute_copies)) if v is not None})
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the groups as this step runs them, after the step pre-hooks and before the post-hooks: what the
        # parameters left to a later update(groups=...) must take (a warm-up hook that sets lr)
        self.groups_of_last_step = self.snapshot()
        self._step(self.param_groups, params, grad_norm, clip_coef, compute_copies, None)
        return loss

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)   # (a copy or an unpickled one: torch gives it a plain table)
        if not isinstance(self._optimizer_step_post_hooks, PostHookTable):
            self._optimizer_step_post_hooks = PostHookTable(self._optimizer_step_post_hooks)

    def run_held_post_hooks(self) -> None:
        """The step post-hooks registered now, with the last step's arguments: for an engine that held them back
        (:class:`PostHookTable`) while it updates the streamed layers after that step returned."""
        args, kwargs = getattr(self, "_last_step_call", ((self,), {}))
        for hook in list(PostHookTable.held_values(self._optimizer_step_post_hooks)):
            hook(self, args, kwargs)

    def check_groups(self) -> None:
        """Refuse settings a step would refuse (a schedule may set betas or a learning rate this optimizer
        cannot run), naming the group, before anything is updated: an engine asks before it starts an update
        it cannot stop halfway."""
        for i, group in enumerate(self.param_groups):
            try:
                _check_group(group, params=False)
            except ValueError as e:
                raise ValueError(f"HybridAdamW parameter group {i}, as the learning-rate schedule or the script "
                                 f"left it: {e}") from None

    @torch.no_grad()
    def update(self, params: Iterable[torch.Tensor], *, clip_coef: float, groups: Sequence[Mapping[str, Any]],
               grads: Optional[Mapping[torch.Tensor, torch.Tensor]] = None, zero_grads: bool = False) -> None:
        """Update ``params`` as part of a step that :meth:`snapshot` captured, without the step hooks.

        For an engine that splits one step into per-layer updates on another thread: ``groups`` (from
        :meth:`snapshot`) fixes the groups and hyperparameters, so a scheduler may already move on, and
        ``grads`` (``{param: gradient}``) are read instead of ``.grad``, so a ``zero_grad`` elsewhere cannot
        drop the update. The optimizer's step hooks belong to the engine's one ``step`` call.

        With ``zero_grads`` every gradient of ``grads`` (without ``grads``: the ``.grad`` of every parameter of
        ``params``, in a group or not) is zero when the call returns, also when the step is skipped: the
        compiled kernels clear each block of a gradient as they read it, while it is in cache, which spares
        the engine a pass over every gradient buffer after the update (other paths zero it after). The
        gradients must not share memory (one cleared would read as zero for the next): refused. If the call
        raises, some may be cleared.
        """
        params = list(params)
        if not zero_grads:
            self._step(groups, params, None, clip_coef, None, grads)
            return
        given = list(grads.values()) if grads is not None else [p.grad for p in params if p.grad is not None]
        _check_disjoint(given)
        zeroed = self._step(groups, params, None, clip_coef, None, grads, zero_grads=True)
        for g in given:
            if id(g) not in zeroed:
                g.zero_()

    def snapshot(self) -> List[Dict[str, Any]]:
        """The parameter groups as they are now: each group's parameter list and settings (tensor values
        copied), for :meth:`update`."""
        return [{k: (list(v) if k == "params" else v.detach().clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in group.items()} for group in self.param_groups]

    def _step(self, groups, params, grad_norm, clip_coef, compute_copies, grads, zero_grads=False) -> set:
        """The step's update; returns the ids of the gradients it cleared (``zero_grads``: those the kernels
        cleared as they read them)."""
        for group in groups:     # settings edited in param_groups after construction are checked too
            _check_group(group, params=False)
        # a negative norm or coefficient (-inf too) turned the step around (gradient ascent); NaN and +inf are a
        # skipped step
        for name, value in (("grad_norm", grad_norm), ("clip_coef", clip_coef)):
            if value is not None and float(value) < 0:
                raise ValueError(f"HybridAdamW.step: {name} must be >= 0, got {float(value)}")
        targets = self._targets(groups, params, grads)
        coef = 1.0 if clip_coef is None else float(clip_coef)
        norm = grad_norm
        if norm is None and clip_coef is None and (self.max_grad_norm > 0 or self.check_finite):
            if params is not None and self.max_grad_norm > 0:
                raise ValueError("HybridAdamW.step(params=...) with max_grad_norm > 0 needs the global grad_norm "
                                 "or clip_coef computed over all gradients")
            norm, _ = clipping.global_grad_norm([g for _, g, _ in targets])
        self.last_step_skipped = False
        if norm is not None and grad_norm is None and clip_coef is None and self.max_grad_norm == 0 and \
                not clipping.is_finite(norm) and all(_squares_finite(g) for _, g, _ in targets):
            norm = None   # only the fp32 sum of squares overflowed: each square is finite, and nothing to clip
            self.last_grad_norm = math.inf   # the norm as torch's get_total_norm gives it, not the last step's
        if norm is not None:
            if not clipping.is_finite(norm):
                self.record_skipped_step(float(norm) if not isinstance(norm, torch.Tensor) else norm.item())
                return set()
            self.last_grad_norm = float(norm)
            if clip_coef is None and self.max_grad_norm > 0:
                coef = float(clipping.clip_coefficient(norm, self.max_grad_norm))
        if not clipping.is_finite(coef):   # a coefficient given beside a finite norm too: every weight NaN
            self.record_skipped_step(None if norm is None else float(norm))
            return set()
        self.last_clip_coef = coef
        copies = self.compute_copies
        if compute_copies:
            copies = dict(copies)
            copies.update(compute_copies)
        zeroed = set()
        for p, g, group in targets:
            if self._update(p, g, group, coef, copies.get(p), zero_grads):
                zeroed.add(id(g))
        return zeroed

    def _targets(self, groups, params, grads) -> List[Tuple[torch.Tensor, torch.Tensor, Mapping[str, Any]]]:
        """(param, gradient, group) for every parameter to update: those of ``params`` (all if None)
        that have a gradient (from ``grads`` when given, else ``.grad``)."""
        wanted = None if params is None else {id(p) for p in params}
        out = []
        for group in groups:
            for p in group["params"]:
                if wanted is not None and id(p) not in wanted:
                    continue
                g = p.grad if grads is None else grads.get(p)
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("HybridAdamW does not support sparse gradients")
                out.append((p, g, group))
        return out

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: Mapping[str, Any], coef: float,
                copy: Optional[torch.Tensor], zero_grad: bool = False) -> bool:
        """One parameter's update; True when the kernel cleared ``g`` as it read it (``zero_grad``)."""
        st = self.state[p]
        if not st:
            st = self._init_state(p, group)
        st["step"] += 1
        beta1, beta2 = group["betas"]
        hyper = make_hyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], step=st["step"], clip=coef,
                           adamw=group["adamw_mode"])
        if "state1" in st:
            return self._update_8bit(p, g, st, group, hyper, copy, zero_grad)
        return self._update_fp32(p, g, st, group, hyper, copy, zero_grad)

    @staticmethod
    def _kernel_ok(p: torch.Tensor, g: torch.Tensor, copy: Optional[torch.Tensor]):
        if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
            return None
        if g.dtype not in (torch.float32, torch.bfloat16, torch.float16) or g.device.type != "cpu":
            return None
        if copy is not None and (copy.device.type != "cpu" or copy.dtype not in (torch.bfloat16, torch.float16)
                                 or not copy.is_contiguous()):
            return None
        return cpu_kernels()

    def _update_8bit(self, p, g, st, group, hyper, copy, zero_grad=False) -> bool:
        bs = st["block_size"]
        q1, q2 = get_qmap("dynamic", p.device), get_qmap("udynamic", p.device)
        k = self._kernel_ok(p, g, copy)
        if k is not None:
            _check_native_operands(p, g, copy, (st["state1"], st["state2"]),
                                   (st["absmax1"], st["absmax2"]), num_blocks(p.numel(), bs))
            clear = zero_grad and g.is_contiguous()   # else the kernel reads a copy of it
            k.adam8bit(hyper, p, g.contiguous(), st["state1"], st["state2"], st["absmax1"], st["absmax2"], q1, q2,
                       bs, copy, zero_grad=clear)
            return _counted(g) if clear else False
        if p.is_cuda and _bnb_cuda_ok(p, g, group, bs):
            import bitsandbytes.functional as bnbF
            beta1, beta2 = group["betas"]
            bnbF.optimizer_update_8bit_blockwise(
                "adam", g, p, st["state1"], st["state2"], beta1, beta2, 0.0, 0.0, group["eps"], st["step"],
                float(group["lr"]), q1.values, q2.values, st["absmax1"], st["absmax2"],
                weight_decay=group["weight_decay"], gnorm_scale=hyper.clip, skip_zeros=False)
            if copy is not None:
                copy.copy_(p)
            return False
        torch_adam8bit(p, g, st, hyper, q1, q2, bs, copy)
        return False

    def _update_fp32(self, p, g, st, group, hyper, copy, zero_grad=False) -> bool:
        k = self._kernel_ok(p, g, copy)
        if k is not None:
            _check_native_operands(p, g, copy, (st["exp_avg"], st["exp_avg_sq"]))
            clear = zero_grad and g.is_contiguous()   # else the kernel reads a copy of it
            k.adam32(hyper, p, g.contiguous(), st["exp_avg"], st["exp_avg_sq"], copy, zero_grad=clear)
            return _counted(g) if clear else False
        if p.device.type != "cpu" and p.dtype == g.dtype == torch.float32 and p.is_contiguous():
            torch_fused_adam32(p, g.contiguous(), st, float(group["lr"]), hyper, copy)
            return False
        torch_adam32(p, g, st, hyper, copy)
        return False


# ---------------------------------------------------------------------- helpers and torch implementation
def _check_disjoint(grads: List[torch.Tensor]) -> None:
    """Refuse gradients that share memory (the same tensor twice, overlapping views): clearing one as it is
    read would hand the other a zero gradient."""
    spans = []
    for g in grads:
        if g.numel():
            start = g.data_ptr()
            last = start + sum((n - 1) * s for n, s in zip(g.shape, g.stride())) * g.element_size()
            spans.append((g.device, start, last + g.element_size()))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError("HybridAdamW.update(zero_grads=True): two of the gradients share memory, so clearing "
                             "one as it is read would give the other a zero gradient; pass them without "
                             "zero_grads, or give each parameter a gradient of its own")


def _counted(g: torch.Tensor) -> bool:
    """A kernel cleared ``g`` past autograd's version counter: count the write (readers that cache a value of
    the gradient, such as the engine's landed square sums, trust the counter). Returns True."""
    torch.autograd.graph.increment_version(g)
    return True


def _contiguous_copy(t: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(p.shape, dtype=dtype, device=p.device).copy_(t.reshape(p.shape))


def _check_flags(group: Mapping[str, Any], where: str = "a parameter group") -> None:
    for flag in ("maximize", "amsgrad"):
        if group.get(flag):
            raise ValueError(f"HybridAdamW does not implement {flag}=True (set in {where}); use torch.optim.AdamW "
                             f"for it")


_SQRT_FP32_MAX = math.sqrt(torch.finfo(torch.float32).max)


def _squares_finite(g: torch.Tensor) -> bool:
    """Whether every element of ``g`` and its square are finite in fp32 (the second moment takes g*g: a
    square that overflows would leave that moment inf, and its weight stuck, for good)."""
    return g.numel() == 0 or bool(g.detach().abs().max().float() <= _SQRT_FP32_MAX)


def _check_hyperparameters(group: Mapping[str, Any]) -> None:
    """torch's AdamW's checks, written so that NaN fails them too (NaN compares false with everything: a
    NaN learning rate would pass ``lr < 0`` and turn every weight into NaN)."""
    lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _check_group(group: Mapping[str, Any], params: bool = True) -> None:
    """What HybridAdamW can run, checked wherever a group can come from (constructor, add_param_group,
    load_state_dict, edits before a step)."""
    _check_hyperparameters(group)
    _check_kind(group["optimizer_states"])
    _check_block(group["block_size"])
    _check_flags(group)
    if params:
        for p in group["params"]:
            if p.is_complex():
                raise ValueError("HybridAdamW keeps real fp32 moments: a complex parameter would lose its imaginary "
                                 "part every step; use torch.optim.AdamW for complex parameters")
            if p.dtype == torch.float64:
                raise ValueError("HybridAdamW keeps its moments and update in fp32; an fp64 parameter would be "
                                 "rounded to fp32 every step: use torch.optim.AdamW for fp64 models")


def _check_kind(kind: str) -> None:
    if kind not in _STATE_KINDS:
        raise ValueError(f"optimizer_states must be '8bit' or 'fp32', got {kind!r}")


def _check_block(bs: int) -> None:
    if not (isinstance(bs, int) and 32 <= bs <= 16384 and bs % 32 == 0):
        raise ValueError(f"block_size must be a multiple of 32 in [32, 16384], got {bs!r}")


def holds_adam_moments(st: Mapping[str, Any]) -> bool:
    """Whether a parameter's saved optimizer state holds Adam's two moments, fp32 or 8-bit: what a load into
    HybridAdamW needs (checked before a checkpoint loads, lazytrain/engine/state_kinds.py)."""
    return _kind_of(st) is not None


def _kind_of(st: Mapping[str, Any]) -> Optional[str]:
    if "state1" in st and "state2" in st:
        return "8bit"
    if "exp_avg" in st and "exp_avg_sq" in st:
        return "fp32"
    return None


def _state_bytes(kind: str, numel: int, block_size: int) -> int:
    if kind == "8bit":
        return 2 * numel + 2 * 4 * num_blocks(numel, block_size)
    return 8 * numel


def _bnb_cuda_ok(p, g, group, bs) -> bool:
    if bs != 256 or not group["adamw_mode"] or g.dtype != p.dtype or not (p.is_contiguous() and g.is_contiguous()):
        return False
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed or no CUDA build: torch path
        return False
    return True


def _adam_math(h, pf: torch.Tensor, gf: torch.Tensor, m: torch.Tensor, v: torch.Tensor):
    """The kernel's arithmetic with torch ops, same operations in the same order (fp32)."""
    g = gf * h.clip
    if not h.adamw:
        g = g + pf * h.weight_decay
    m = m * h.beta1 + g * h.one_minus_beta1
    v = v * h.beta2 + (g * g) * h.one_minus_beta2
    if h.adamw:
        pf = pf * h.decay
    # torch's fp32 CPU sqrt is not correctly rounded; the fp64 sqrt rounded to fp32 is (as in the kernel)
    denom = torch.sqrt(v.double()).float() * h.inv_bc2_sqrt + h.eps
    pf = pf - (m / denom) * h.step_size
    return pf, m, v


def _requant(x: torch.Tensor, qmap: QuantMap, bs: int, fit_ends: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise codes and absmax of moments, clamped to finite values first: one overflowed moment (a
    gradient whose square overflows fp32) would make its block's absmax inf and every value in the block NaN
    once dequantized (0 * inf); clamped, its own update stays about 0 as AdamW's, and the block stays finite.
    A NaN moment is not its block's absmax and encodes as +-absmax, as in the kernel. ``fit_ends``: each
    block's scale fitted to both ends of the map (:func:`_fitted`)."""
    x = x.clamp(-_MOMENT_MAX, _MOMENT_MAX)   # a NaN stays NaN
    n = x.numel()
    nb = num_blocks(n, bs)
    xb = torch.nn.functional.pad(x, (0, nb * bs - n)).view(nb, bs)
    finite = xb.nan_to_num(nan=0.0)   # as the kernel's: a NaN is not the block's max
    if fit_ends:
        low, high = float(qmap.values[0]), float(qmap.values[-1])
        absmax = finite.clamp(min=0).amax(dim=1) / high
        if low < 0:   # at most _MOMENT_MAX, whose reciprocal is a normal float (a clamped -2**126 encodes as low)
            absmax = torch.maximum(absmax, finite.clamp(max=0).amin(dim=1) / low).clamp(max=_MOMENT_MAX)
    else:
        absmax = finite.abs().amax(dim=1)
    scale = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    return encode(xb * scale[:, None], qmap).reshape(-1)[:n], absmax


_MOMENT_MAX = 2.0 ** 126   # as the kernel's: 1 / absmax stays a normal float (1 / FLT_MAX is flushed with denormals)

#: elements converted at a time between fp32 and 8-bit moments (the temporaries of a few blocks, not of a
#: whole embedding)
_CONVERT_CHUNK = 1 << 24


def _fitted(x: torch.Tensor, qmap: QuantMap, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`_requant`, each block's scale fitted to both ends of the map: the signed map ends at -0.99297,
    not -1, so a block whose largest magnitude is negative scaled by ``|x|.max()`` came back 0.7% smaller
    after a round trip through fp32 (every value of the block; ten round trips, 6.8%). Scaled so that a
    negative extreme meets the map's lowest code, decoded values quantize to their own codes again (their
    absmax to within an ulp)."""
    return _requant(x, qmap, bs, fit_ends=True)


def _quantized(x: torch.Tensor, qmap: QuantMap, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 ``x`` (moments written or loaded, not a step's) as uint8 codes and per-block absmax on
    ``qmap``'s device (:func:`_fitted`), a chunk of whole blocks at a time."""
    n, device = x.numel(), qmap.values.device
    codes = torch.empty(n, dtype=torch.uint8, device=device)
    absmax = torch.empty(num_blocks(n, bs), dtype=torch.float32, device=device)
    step = max(bs, _CONVERT_CHUNK // bs * bs)
    for start in range(0, n, step):
        c, a = _fitted(x[start:start + step].to(device, torch.float32), qmap, bs)
        codes[start:start + c.numel()] = c
        absmax[start // bs:start // bs + a.numel()] = a
    return codes, absmax


def _dequant_chunks(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap, bs: int, max_elems: int):
    """Uint8 ``codes`` as fp32 values (what a step dequantizes them to), flat, in order, a chunk of at most
    ``max_elems`` elements (whole blocks) at a time: never the whole tensor's temporaries at once."""
    codes = codes.reshape(-1)
    step = max(bs, max_elems // bs * bs)
    for start in range(0, codes.numel(), step):
        part = codes[start:start + step]
        yield _dequant(part, absmax[start // bs:start // bs + num_blocks(part.numel(), bs)], qmap, bs)


def _dequantized(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap, bs: int) -> torch.Tensor:
    """Flat uint8 ``codes`` as one flat fp32 tensor, dequantized by :func:`_dequant_chunks`."""
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    start = 0
    for part in _dequant_chunks(codes, absmax, qmap, bs, _CONVERT_CHUNK):
        out[start:start + part.numel()] = part
        start += part.numel()
    return out


def _dequant(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap, bs: int) -> torch.Tensor:
    n = codes.numel()
    nb = num_blocks(n, bs)
    vals = qmap.values[codes.reshape(-1).long()]
    return (torch.nn.functional.pad(vals, (0, nb * bs - n)).view(nb, bs) * absmax[:, None]).reshape(-1)[:n]


def torch_adam8bit(p, g, st, h, q1: QuantMap, q2: QuantMap, bs: int, copy=None) -> None:
    """Reference/fallback 8-bit update with torch ops (any device); same results as the C++ kernel."""
    m = _dequant(st["state1"], st["absmax1"], q1, bs)
    v = _dequant(st["state2"], st["absmax2"], q2, bs)
    pf, m, v = _adam_math(h, p.detach().reshape(-1).float(), g.reshape(-1).float(), m, v)
    c1, a1 = _requant(m, q1, bs)
    c2, a2 = _requant(v, q2, bs)
    st["state1"].view(-1).copy_(c1)
    st["state2"].view(-1).copy_(c2)
    st["absmax1"].copy_(a1)
    st["absmax2"].copy_(a2)
    p.detach().copy_(pf.view(p.shape))
    if copy is not None:
        copy.copy_(pf.view(p.shape))


def torch_fused_adam32(p, g, st, lr: float, h, copy=None) -> None:
    """fp32-state update through torch's fused Adam(W) kernel (for CUDA tensors): in place, with no
    temporaries the size of the parameter (an embedding or LM head can be a large share of GPU memory).
    The clip coefficient goes in as the kernel's gradient scale, which divides; the kernel may leave the
    gradient divided by it."""
    fused = torch._fused_adamw_ if h.adamw else torch._fused_adam_
    step = torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device)
    scale = None if h.clip == 1.0 else torch.tensor(1.0 / h.clip, dtype=torch.float32, device=p.device)
    fused([p.detach()], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [], [step], lr=lr, beta1=h.beta1, beta2=h.beta2,
          weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
    if copy is not None:
        copy.copy_(p)


def torch_adam32(p, g, st, h, copy=None) -> None:
    """Reference/fallback fp32-state update with torch ops; same results as the C++ kernel."""
    pf, m, v = _adam_math(h, p.detach().float(), g.float(), st["exp_avg"], st["exp_avg_sq"])
    st["exp_avg"].copy_(m)
    st["exp_avg_sq"].copy_(v)
    p.detach().copy_(pf)
    if copy is not None:
        copy.copy_(pf)


def _check_native_operands(p: torch.Tensor, g: torch.Tensor, copy: Optional[torch.Tensor], moments: tuple,
                           absmax: tuple = (), blocks: int = 0) -> None:
    """The native kernels read and write as many elements as ``p`` holds in every tensor they are given, as
    contiguous host memory of their dtype: a state of another size, dtype, layout or device (a checkpoint of
    another model written into ``state`` by hand) is refused here rather than read or written past its end."""
    n = p.numel()
    sizes = [("gradient", g), ("compute copy", copy)] + [("moment", m) for m in moments]
    for what, t in sizes:
        if t is not None and t.numel() != n:
            raise RuntimeError(f"HybridAdamW: a parameter of shape {tuple(p.shape)} has a {what} of "
                               f"{t.numel()} elements, not {n}")
    kind = torch.uint8 if absmax else torch.float32
    for what, t, dtype in [("moment", m, kind) for m in moments] + [("absmax", a, torch.float32) for a in absmax]:
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise RuntimeError(f"HybridAdamW: a parameter of shape {tuple(p.shape)} has a {what} that is "
                               f"{t.dtype}, {'' if t.is_contiguous() else 'not '}contiguous, on {t.device}: the "
                               f"host kernel needs {dtype}, contiguous, in host memory")
    for t in absmax:
        if t.numel() != blocks:
            raise RuntimeError(f"HybridAdamW: a parameter of shape {tuple(p.shape)} has {t.numel()} absmax values, "
                               f"not {blocks} (one per block)")
