"""Ours: the query streams of language/datasets.py's Dataset.torch_dataset (the original's tf.data repeat and shard,
as index arithmetic over a prepared array, or text by text from an endless generator), one per rank this
process carries."""

import itertools

import numpy as np
import torch

from lm_human_preferences.utils import core, ranks


class RankShards:
    """The query streams of the ranks this process carries: next_batch and next() read the stream of the
    rank whose section is running (ranks.get_rank()); a process carrying one rank may call them anywhere.
    fingerprint: what identifies the queries (a run records it: training/run.py)."""

    def __init__(self, shards, *, fingerprint):
        self.shards = shards
        self.fingerprint = fingerprint

    def _shard(self):
        if len(self.shards) > 1 and not ranks.in_section():
            raise RuntimeError(f'this process carries ranks {sorted(self.shards)}: read their queries inside '
                               f'their rank sections (utils/ranks.py)')
        return self.shards[ranks.get_rank()]

    def next_batch(self, batch_size):
        return self._shard().next_batch(batch_size)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._shard())


class ArrayQueries:
    """The stream queries[order] repeated (repeat_count times, or forever); shard shard_idx of num_shards
    takes stream positions shard_idx, shard_idx + num_shards, ... (tf.data's repeat then shard)."""

    def __init__(self, queries, order, *, num_shards, shard_idx, repeat_count):
        self.queries = queries
        self.order = order
        self.num_shards = num_shards
        self.shard_idx = shard_idx
        total = None if repeat_count is None else len(order) * repeat_count
        self._limit = None if total is None else max(0, core.ceil_div(total - shard_idx, num_shards))
        self._taken = 0

    def next_batch(self, batch_size):
        """The next batch_size queries of this shard; StopIteration when fewer remain (drop_remainder)."""
        if self._limit is not None and self._taken + batch_size > self._limit:
            raise StopIteration
        k = np.arange(self._taken, self._taken + batch_size)
        self._taken += batch_size
        rows = self.order[(self.shard_idx + k * self.num_shards) % len(self.order)]
        return torch.from_numpy(self.queries[rows].astype(np.int64))

    def __iter__(self):
        return self

    def __next__(self):
        return dict(tokens=self.next_batch(1)[0])


class GeneratorQueries:
    """Queries from an endless text generator, encoded one by one; same interface as ArrayQueries."""

    def __init__(self, make_texts, *, encoder, cut, num_shards, shard_idx, repeat_count, desc):
        def stream():
            for _ in (itertools.count() if repeat_count is None else range(repeat_count)):
                produced = 0
                for text in make_texts():
                    tokens = cut(encoder.encode(text))
                    if tokens is not None:
                        produced += 1
                        yield tokens
                if produced == 0:  # with repeat, an empty pass would spin forever
                    raise ValueError(f'dataset {desc}: a whole pass over its texts gave no query')
        self._items = itertools.islice(stream(), shard_idx, None, num_shards)

    def next_batch(self, batch_size):
        rows = list(itertools.islice(self._items, batch_size))
        if len(rows) < batch_size:
            raise StopIteration
        return torch.tensor(rows, dtype=torch.long)

    def __iter__(self):
        return self

    def __next__(self):
        return dict(tokens=self.next_batch(1)[0])
