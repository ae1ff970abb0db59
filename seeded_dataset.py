"""Random augmentation that is the same at any world size, in any loader worker and after a resume: copy it next to
distributed.py (optional).

    from seeded_dataset import seeded_dataset

    data = seeded_dataset(train_set, seed=0)           # a sample's augmentation: f(seed, epoch, index) only
    sampler = distributed.data_sampler(data, shuffle=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                       # passes the epoch on to the dataset: new draws each epoch
        for x, y in DataLoader(data, batch_size=32, sampler=sampler, num_workers=2): ...

Each item is read with torch's CPU generator, Python's ``random`` and (where the process has imported it) numpy's
global generator seeded from (seed, epoch, index). So the sample gets the same draws whichever rank or loader worker
reads it, at any world size and before or after a resume, and new ones each epoch. In the main process the caller's
generators are given back once a batch is read: the training loop's own draws (dropout) go on as if no item had been
read. CUDA's generators are never touched; numpy is never imported (it stays optional).

A generator the dataset owns (albumentations >= 1.4.21 and MONAI keep an np.random.Generator) is out of reach: seed
it per item from the item's seed, ``torch.initial_seed()`` inside ``__getitem__``::

    def __getitem__(self, i):
        rng = np.random.default_rng(torch.initial_seed())   # this item's own draws
        return self.crop(self.images[i], rng)

A collate function's draws (a mixup in ``collate_fn``) in a loader worker repeat across resumes only because a
worker's generators are left seeded by the batch's last item read: that holds for seeded_dataset's reads in
workers, not in the main process (where the caller's generators are given back); draw such randomness in the
training loop instead (the Checkpointer saves the rank's generators), or from a generator seeded by the batch's
indices. ``distributed.check_repeatable(data)`` names a dataset that still draws from elsewhere. It uses only
distributed.py's public names and torch; distributed.py does not import it.
"""
from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

__all__ = ["seeded_dataset", "SeededDataset"]


def seeded_dataset(dataset: Dataset, seed: int = 0) -> SeededDataset:
    """``dataset`` whose every item is read under seeds from (``seed``, the epoch, the index). Wrap it before
    distributed.data_sampler, whose ``set_epoch`` passes the epoch on (or call ``set_epoch`` on it yourself)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seeded_dataset: seed must be an integer, got: {seed!r}")
    if isinstance(dataset, IterableDataset):
        raise TypeError(f"seeded_dataset: got an IterableDataset ({type(dataset).__name__}), which has no indices to "
                        "seed from: read it with sharded_stream(shards, read, transform=...) (sharded_stream.py), "
                        "whose transform draws from seeds of each record's key, or loop over stop_together(loader) "
                        "for a stream of your own")
    return SeededDataset(dataset, seed)


class SeededDataset(Dataset):
    """seeded_dataset's wrapper; other attributes are the wrapped dataset's. The epoch lives in shared memory:
    DataLoader workers, forked or spawned, and persistent ones that keep their copy of the dataset across epochs,
    all read the epoch the rank set."""

    seeded_per_item = True  # what distributed.check_repeatable reads: an unrepeatable item is the dataset's own

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._bits = None

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.__getitems__((index,))[0]

    def __getitems__(self, indices: Sequence[Any]) -> list:
        """The items at ``indices``, each read under its own seeds. A DataLoader reads a batch through this: in the
        main process the caller's generators are saved and given back once a batch, not once an item."""
        numpy = sys.modules.get("numpy")  # seeded where the process has it, never imported: numpy stays optional
        if torch.utils.data.get_worker_info() is not None:  # a loader worker's generators are its own
            if numpy is not None:
                self._keep_numpy_generator_seated(numpy)
            return [self._seeded_read(index, numpy) for index in indices]
        cpu = torch.default_generator  # not torch.manual_seed, which reseeds every CUDA device too
        torch_state, python_state = cpu.get_state(), random.getstate()
        give_numpy_back = self._seat_numpy_generator(numpy) if numpy is not None else None
        try:
            return [self._seeded_read(index, numpy) for index in indices]
        finally:  # the training loop's draws (dropout) go on as if no item had been read
            cpu.set_state(torch_state)
            random.setstate(python_state)
            if give_numpy_back is not None:
                give_numpy_back()

    def _seeded_read(self, index: Any, numpy: Any) -> Any:
        # blake2b: a seed of 63 bits from the three numbers, the same in every process (unlike hash()).
        key = f"{self.seed}/{int(self._epoch)}/{index}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed & 0xFFFFFFFF)
        return self.dataset[index]

    def _seat_numpy_generator(self, numpy: Any) -> Callable[[], None]:
        """This wrapper's own MT19937 as numpy's global bit generator; returns what gives the caller's back. Swapped,
        not copied: numpy's get_state + set_state would cost more than the read. numpy < 1.24 cannot swap: its state
        is copied. Of the caller's draws, only a normal held back by np.random.randn from an odd draw is drawn anew."""
        if not hasattr(numpy.random, "set_bit_generator"):
            state = numpy.random.get_state()
            return lambda: numpy.random.set_state(state)
        if self._bits is None:
            self._bits = numpy.random.MT19937()
        callers = numpy.random.get_bit_generator()
        numpy.random.set_bit_generator(self._bits)
        return lambda: numpy.random.set_bit_generator(callers)

    def _keep_numpy_generator_seated(self, numpy: Any) -> None:
        """In a loader worker, this wrapper's MT19937 stays numpy's global bit generator (checked once a batch): a
        worker_init_fn's PCG64, seeded per item, would draw other numbers than the main process's reads."""
        if hasattr(numpy.random, "get_bit_generator") and numpy.random.get_bit_generator() is not self._bits:
            self._seat_numpy_generator(numpy)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed", "_epoch", "_bits") or name.startswith("__"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)
