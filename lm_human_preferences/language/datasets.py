"""Query datasets: a registry of text sources and the pipeline that turns texts into queries.

The pipeline is the original's tf_dataset: encode a text; with a start token, drop everything up to
and including its first occurrence (the whole text stays if that occurrence is its last token) and
skip texts without one; keep `sequence_length` tokens; with an end token, cut after its last
occurrence and skip texts without one; right-pad with the padding token. The queries are shuffled
with a fixed seed, repeated, and rank r of N takes every N-th one.

TF -> torch: tf.data's from_generator/repeat/shard pipeline becomes index arithmetic over an array.
The queries of a finite source are computed once per (texts, encoding, query settings) and saved as
.npy under gcs.datasets_dir()/<name>/ (see datasets/README.md); later runs memory-map them, so a
batch costs one fancy-index. Endless generator sources (`test`) are still encoded text by text.
"""

import hashlib
import io
import itertools
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Dict

import numpy as np
import torch
from tqdm import tqdm

from lm_human_preferences.datasets.books import books_texts
from lm_human_preferences.datasets.cnndm import cnndm_texts
from lm_human_preferences.datasets.local import local_texts
from lm_human_preferences.datasets.tldr import tldr_texts
from lm_human_preferences.utils import core, files, gcs, ranks

_registry: Dict[str, "Dataset"] = {}

# Part of every prepared file's key: bump it when the meaning of the prepared files changes.
_CACHE_VERSION = 1
# Encoded into the cache key, so that queries prepared with one encoding are never read with another.
_ENCODER_PROBE = ("Hello, World! The quick brown fox jumps over the lazy dog.\n\nTL;DR: it's 1,234 \u2014 "
                  "na\u00efve caf\u00e9 \u2018quoted\u2019 \u201cdouble\u201d\t  spaces\n")


class Dataset:
    def __init__(self, name, *, generator=None, texts=None, cache_texts=True, cache_name=None):
        """A query source, registered under `name`. Exactly one of:

        generator(mode, seed=0, shuffle=False): an endless iterator of texts (the original's interface;
            the `test` dataset).
        texts(mode): the finite list of a split's texts in source order. We apply the original's shuffle
            (its generators did). With cache_texts, a copy is kept under gcs.datasets_dir()/<cache_name>/
            so the download and clean-up happen once.
        """
        if (generator is None) == (texts is None):
            raise ValueError(f'dataset {name}: give exactly one of generator= and texts=')
        assert name not in _registry, f'dataset {name} is already registered'
        _registry[name] = self

        self.name = name
        self.cache_name = name if cache_name is None else cache_name

        self.generator = generator
        self.texts = texts
        self.cache_texts = cache_texts

    def torch_dataset(
            self,
            sequence_length,
            *,
            mode,
            encoder=None,
            seed=0,
            shuffle=True,
            repeat_count=None,  # Defaults to infinite repeat
            # trims so that it starts right after start token
            start_token=None,
            # trims off last end_token
            end_token=None,
            padding_token=None,
    ):
        """Each rank's share of the query stream: an iterator of dict(tokens=LongTensor [sequence_length])
        with next_batch(batch_size) -> LongTensor [batch_size, sequence_length], giving the share of the
        rank whose section calls it (the original's tf_dataset; its `comm` is replaced by the ranks this
        process carries, utils/ranks.py). Collective over processes: call it outside the rank sections."""
        if padding_token is None:
            padding_token = encoder.padding_token
        cut = partial(cut_query, sequence_length=sequence_length, start_token=start_token,
                      end_token=end_token, padding_token=padding_token)
        num_shards = core.get_world_size()
        if num_shards > 1:
            assert seed is not None

        if self.generator is not None:
            make_texts = partial(self.generator, mode, seed=seed, shuffle=shuffle)
            return RankShards({rank: GeneratorQueries(
                make_texts, encoder=encoder, cut=cut, num_shards=num_shards, shard_idx=rank,
                repeat_count=repeat_count, desc=f'{self.name} {mode}') for rank in ranks.local_ranks()},
                fingerprint=dict(dataset=self.name, mode=mode, source='generator'))

        queries, valid, key = self._prepared_queries(mode, encoder=encoder, cut=cut)
        order = list(range(len(queries)))
        if shuffle:
            # The original: random.seed(seed); random.shuffle(datas). A private Random gives the same
            # permutation without reseeding the global `random` module.
            random.Random(seed).shuffle(order)
        order = np.asarray(order, dtype=np.int64)
        order = order[valid[order]]  # texts the pipeline skipped take no place in the stream
        if len(order) == 0:
            raise ValueError(
                f"dataset {self.name} mode {mode}: none of its {len(queries)} texts gives a query "
                f"(start_token={start_token}, end_token={end_token}: every text lacks one of them)")
        return RankShards({rank: ArrayQueries(queries, order, num_shards=num_shards, shard_idx=rank,
                                              repeat_count=repeat_count) for rank in ranks.local_ranks()},
                          fingerprint=dict(dataset=self.name, mode=mode, sha256=_sha256_rows(queries, order),
                                           queries=len(order)))

    def _prepared_queries(self, mode, *, encoder, cut):
        """(queries [n_texts, sequence_length], valid [n_texts] bool, key) for all texts of the split in
        source order, from the cache or computed now (and cached); key identifies them (a hash of the
        texts, the encoding and the query settings)."""
        texts, texts_id = self._texts_and_id(mode)
        settings = dict(version=_CACHE_VERSION, dataset=self.name, mode=mode, texts_sha1=texts_id,
                        encoder_probe=encoder.encode(_ENCODER_PROBE), **cut.keywords)
        key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        base = os.path.join(gcs.datasets_dir(), self.cache_name, f'{mode}.queries-{key}')
        # Rank 0's process decides, so that every process takes the same branch (the downloads inside are
        # collective).
        if core.mpi_bcast(os.path.exists(base + '.npy')):
            return np.load(base + '.npy', mmap_mode='r'), np.load(base + '.valid.npy'), key

        # Every process encodes (a minute or two for the largest splits) instead of waiting for rank 0
        # inside a collective, which could time out; rank 0 alone writes the files.
        if texts is None:
            texts = _read_jsonl(self._texts_path(mode))
        queries, valid = _encode_queries(texts, encoder=encoder, cut=cut, desc=f'{self.name} {mode}: encoding queries')
        if core.is_root():
            os.makedirs(os.path.dirname(base), exist_ok=True)
            files.atomic_write(base + '.json', json.dumps(settings, indent=2).encode())
            files.atomic_write(base + '.valid.npy', _npy_bytes(valid))
            files.atomic_write(base + '.npy', _npy_bytes(queries))  # last: its presence marks completion
        return queries, valid, key

    def _texts_path(self, mode):
        return os.path.join(gcs.datasets_dir(), self.cache_name, f'{mode}.texts.jsonl')

    def _texts_and_id(self, mode):
        """(the split's texts, or None when they are cached and not loaded; sha1 of the texts)."""
        if not self.cache_texts:
            texts = self.texts(mode)
            return texts, _texts_sha1(texts)
        path = self._texts_path(mode)
        if core.mpi_bcast(os.path.exists(path)):
            with open(path + '.sha1') as f:
                return None, f.read().strip()
        texts = self.texts(mode)
        texts_id = _texts_sha1(texts)
        if core.is_root():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            files.atomic_write(path + '.sha1', texts_id.encode())
            # The original's book_passages format: one JSON string per line.
            files.atomic_write(path, b''.join(json.dumps(t).encode() + b'\n' for t in texts))
        return texts, texts_id


def cut_query(tokens, *, sequence_length, start_token, end_token, padding_token):
    """The original's per-text query logic: the padded query (a list), or None to skip the text."""
    if start_token is not None:
        try:
            first_index = tokens.index(start_token)+1
        except ValueError:
            return None
        if first_index < len(tokens):
            tokens = tokens[first_index:]

    tokens = tokens[:sequence_length]

    if end_token is not None:
        try:
            last_index = len(tokens)-tokens[::-1].index(end_token)
        except ValueError:
            return None
        tokens = tokens[:last_index]

    if len(tokens) < sequence_length:
        tokens = tokens + [padding_token] * (sequence_length - len(tokens))

    assert len(tokens) == sequence_length
    return tokens


class RankShards:
    """The query streams of the ranks this process carries: next_batch and next() read the stream of the
    rank whose section is running (core.get_rank()); a process carrying one rank may call them anywhere.
    fingerprint: what identifies the queries (a run records it: training/run.py)."""

    def __init__(self, shards, *, fingerprint):
        self.shards = shards
        self.fingerprint = fingerprint

    def _shard(self):
        if len(self.shards) > 1 and not ranks.in_section():
            raise RuntimeError(f'this process carries ranks {sorted(self.shards)}: read their queries inside '
                               f'their rank sections (utils/ranks.py)')
        return self.shards[core.get_rank()]

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


def _encode_queries(texts, *, encoder, cut, desc):
    """Encode and cut every text: (queries [n, sequence_length], valid [n]); uint16 when the ids fit."""
    sequence_length = cut.keywords['sequence_length']
    queries = np.zeros((len(texts), sequence_length), dtype=np.int32)
    valid = np.zeros(len(texts), dtype=bool)
    chunk = 256
    # Threads: tiktoken releases the GIL while encoding. Each process prepares (see _prepared_queries), so
    # the cores are shared among the processes.
    workers = max(1, (os.cpu_count() or 1) // ranks.num_processes())
    # A bar on a terminal; in a log (not a TTY) its carriage returns would make one garbled line: one
    # plain line at the end instead.
    bar = core.is_root() and sys.stderr.isatty()
    started = time.time()
    with ThreadPoolExecutor(workers) as pool, tqdm(total=len(texts), desc=desc, unit='text',
                                                    disable=not bar) as progress:
        cut_chunk = lambda i: [cut(encoder.encode(t)) for t in texts[i:i + chunk]]
        for i, rows in zip(range(0, len(texts), chunk), pool.map(cut_chunk, range(0, len(texts), chunk))):
            for j, tokens in enumerate(rows):
                if tokens is not None:
                    queries[i + j] = tokens
                    valid[i + j] = True
            progress.update(len(rows))
    if core.is_root() and not bar:
        print(f'{desc}: {len(texts)} texts in {time.time() - started:.1f}s', flush=True)
    if queries.size and 0 <= queries.min() and queries.max() < 2 ** 16:
        queries = queries.astype(np.uint16)  # GPT-2 ids and its padding id 50259 fit: half the size
    return queries, valid


def _texts_sha1(texts):
    h = hashlib.sha1()
    for t in texts:
        h.update(json.dumps(t).encode() + b'\n')
    return h.hexdigest()


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _sha256_rows(array, order):
    """The sha256 of array's rows in `order` (the query stream a run reads, before sharding), hashed in
    chunks: a memory-mapped array is never copied whole."""
    h = hashlib.sha256()
    for start in range(0, len(order), 1 << 16):
        h.update(np.ascontiguousarray(array[order[start:start + (1 << 16)]]).tobytes())
    return h.hexdigest()


def _npy_bytes(array):
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def check_dataset_name(dataset, *, name):
    """Ours, at launch: a one-line ValueError for a query dataset that does not exist (the hparam is `name`)."""
    if dataset in _registry:
        return
    if isinstance(dataset, str) and dataset.startswith('local:'):
        directory = os.path.expanduser(dataset[len('local:'):])
        if not os.path.isdir(directory):
            raise ValueError(f"hyperparameter '{name}' is {dataset!r}: {directory} is not a directory")
        return
    raise ValueError(f"hyperparameter '{name}' is {dataset!r}: choose from {', '.join(sorted(_registry))}, or "
                     f"local:<directory of .txt files>")


def get_dataset(name) -> Dataset:
    """A registered dataset, or `local:<dir>`: the .txt files under <dir> (datasets/local.py)."""
    if name not in _registry and name.startswith('local:'):
        directory = os.path.abspath(os.path.expanduser(name[len('local:'):]))
        # Not cached as texts (reading local files is fast, and they may change); the prepared queries
        # are keyed by the texts' hash, so an edited corpus is prepared again.
        Dataset(name, texts=partial(local_texts, directory), cache_texts=False,
                cache_name='local-' + hashlib.sha1(directory.encode()).hexdigest()[:12])
    if name not in _registry:
        raise KeyError(f"unknown query dataset '{name}' (registered: {', '.join(sorted(_registry))}; "
                       f"or local:<directory of .txt files>)")
    return _registry[name]

CnnDm = Dataset(
    "cnndm",
    texts=cnndm_texts,
)

Tldr = Dataset(
    "tldr",
    texts=tldr_texts,
)

Books = Dataset(
    "books",
    texts=books_texts,
)

def test_generator(mode, seed=0, shuffle=False):
    while True:
        yield ''.join([random.choice('abcdefghijklmnopqrstuvwxyz.') for _ in range(40)])

Test = Dataset(
    "test",
    generator=test_generator
)
