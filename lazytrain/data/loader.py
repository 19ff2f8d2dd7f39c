"""The training loader ``initialize`` and ``deepspeed_io`` build, epoch by epoch as DeepSpeed's.

A DistributedSampler gives the same order every pass unless its epoch moves. DeepSpeed's loader (after 0.19.8)
moves the sampler it built itself to the next epoch at each pass, unless the script set the epoch since the
last one (``loader.data_sampler.set_epoch(k)``, as a resumed run or a loop over epochs does); a sampler the
script passed in is the script's own, and left alone. Here likewise."""
from __future__ import annotations

import torch


class EpochTrackingSampler(torch.utils.data.distributed.DistributedSampler):
    """A DistributedSampler that knows whether its epoch was set since the loader's last pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_set = True


class EpochDataLoader(torch.utils.data.DataLoader):
    """Each pass is a new epoch for a sampler the loader built (:class:`EpochTrackingSampler`): the pass after
    one the script did not follow with ``set_epoch`` takes the next epoch's order, so every rank reshuffles
    as a single process's shuffling loader does, and ranks that set the same epoch see the same split."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._passes = 0

    @property
    def data_sampler(self):
        """DeepSpeed's name for the loader's sampler (scripts call ``loader.data_sampler.set_epoch(epoch)``)."""
        return self.sampler

    def __iter__(self):
        sampler = self.sampler
        if isinstance(sampler, EpochTrackingSampler):
            if self._passes and not sampler.epoch_set:
                sampler.set_epoch(sampler.epoch + 1)
            sampler.epoch_set = False
        self._passes += 1
        return super().__iter__()


def is_dataset(data) -> bool:
    """What DeepSpeed's loader takes: an iterable dataset, or anything indexable with a length (a torch
    Dataset, a list, a Hugging Face ``datasets.Dataset``)."""
    return isinstance(data, torch.utils.data.IterableDataset) or \
        (hasattr(data, "__getitem__") and hasattr(data, "__len__"))


class RepeatingLoader:
    """DeepSpeed's ``deepspeed.utils.RepeatingLoader``: ``loader`` iterated again from its start each time it ends,
    for scripts that draw a fixed number of batches (``next(data_iter)`` per step) rather than epochs. Each new
    pass is a new ``iter(loader)``: the engine's loader moves its sampler to the next epoch then. A loader that
    yields nothing ends the iteration (StopIteration), as DeepSpeed's does."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
