"""The measurement of what a traced block's graph saves (executor._SavedBytes): it changes no result, keeps
autograd's in-place check, and counts tensors whose data sit in other tensors (sparse, wrapper subclasses)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import lazytrain
from lazytrain.engine.executor import _SavedBytes
from engine_models import MLPBlock, ModuleListLM, batches, lm_loss


class SparseMixBlock(MLPBlock):
    def forward(self, x, adj):   # a graph layer's neighbour mixing: a sparse matrix the call passes in
        h = self.fc1(self.norm(x))
        mixed = torch.sparse.mm(adj, h.flatten(0, 1)).view_as(h)
        return x + self.fc2(F.gelu(mixed))


class SparseMixLM(ModuleListLM):
    block = SparseMixBlock
    def forward(self, ids):
        n = ids.numel()
        adj = (torch.eye(n) + torch.eye(n).roll(1, 0)).to_sparse()
        x = self.emb(ids)
        for blk in self.stack:
            x = blk(x, adj)
        return self.head(self.extra[0](x))


def _train(trace):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"policy": "keep_all", "last_segment_graph": False, "device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=SparseMixLM(n_layers=3), config=cfg)
    losses = []
    for x, y in batches(3):
        if trace:
            engine.trace_next_step()
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    saved = [s.args.get("saved_bytes") for s in engine.last_trace.spans if s.name.startswith("diff")] if trace else None
    engine.destroy()
    return losses, saved


def test_a_block_that_uses_a_sparse_tensor_trains_alike_traced_or_not():
    plain, _ = _train(False)
    traced, saved = _train(True)
    assert traced == plain
    assert saved and all(isinstance(b, int) and b > 0 for b in saved)


def test_a_saved_tensor_changed_in_place_is_refused_with_the_measurement_as_without():
    x = torch.randn(4, requires_grad=True)
    with _SavedBytes([x]):
        y = x * 2
        z = y * y
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_storageless_tensors_are_counted_by_what_holds_them():
    from torch.testing._internal.two_tensor import TwoTensor
    x = torch.randn(4, 4, requires_grad=True)
    sp = torch.eye(4).to_sparse()
    c = _SavedBytes([x])
    with c:
        torch.sparse.mm(sp, x)
    assert c.nbytes == 2 * 4 * 8 + 4 * 4   # int64 indices, fp32 values
    a = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))
    c = _SavedBytes([x])
    with c:
        y = a * x
    assert c.nbytes == 2 * 4 * 4 * 4
    y.sum().backward()
