"""Which storages hold a tensor's data, for the engine's checks by storage (what a block's autograd saves
beyond what it is given; what a selective layer's op writes into): a sparse tensor's parts and a wrapper
subclass's inner tensors have no storage of their own to ask."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


# the strided tensors a sparse tensor is made of, by layout (what torch.save pickles it as: Tensor.__reduce_ex__)
SPARSE_PARTS = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_bsr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
    torch.sparse_bsc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


def storages(t: torch.Tensor) -> list[tuple[tuple, int]]:
    """((device, data pointer), bytes) of each storage holding ``t``'s data: a sparse tensor's indices and
    values, a wrapper subclass's inner tensors; none where no storage can be reached (a jagged nested tensor)."""
    if t.layout in SPARSE_PARTS:
        parts = SPARSE_PARTS[t.layout](t)
    elif is_traceable_wrapper_subclass(t):
        parts = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    else:
        try:
            s = t.untyped_storage()
            return [((t.device, s.data_ptr()), s.nbytes())]
        except (RuntimeError, NotImplementedError):
            return []
    return [kb for p in parts if isinstance(p, torch.Tensor) for kb in storages(p)]
