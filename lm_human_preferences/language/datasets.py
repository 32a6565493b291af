"""Query datasets: a registry of text sources and the pipeline that turns texts into queries.

The pipeline is the original's tf_dataset: encode a text; with a start token, drop everything up to
and including its first occurrence (the whole text stays if that occurrence is its last token) and
skip texts without one; keep `sequence_length` tokens; with an end token, cut after its last
occurrence and skip texts without one; right-pad with the padding token. The queries are shuffled
with a fixed seed, repeated, and rank r of N takes every N-th one.

TF -> torch: tf.data's from_generator/repeat/shard pipeline becomes index arithmetic over an array of
the queries, prepared once and cached (ours: language/query_cache.py, language/query_streams.py).
"""

import hashlib
import os
import random
from functools import partial
from typing import Dict

import numpy as np

from lm_human_preferences.datasets.books import books_texts
from lm_human_preferences.datasets.cnndm import cnndm_texts
from lm_human_preferences.datasets.local import local_texts
from lm_human_preferences.datasets.tldr import tldr_texts
from lm_human_preferences.language import query_cache, query_streams
from lm_human_preferences.utils import ranks

_registry: Dict[str, "Dataset"] = {}


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
        num_shards = ranks.get_world_size()
        if num_shards > 1:
            assert seed is not None

        if self.generator is not None:
            make_texts = partial(self.generator, mode, seed=seed, shuffle=shuffle)
            return query_streams.RankShards({rank: query_streams.GeneratorQueries(
                make_texts, encoder=encoder, cut=cut, num_shards=num_shards, shard_idx=rank,
                repeat_count=repeat_count, desc=f'{self.name} {mode}') for rank in ranks.local_ranks()},
                fingerprint=dict(dataset=self.name, mode=mode, source='generator'))

        queries, valid, key = query_cache.prepared_queries(self, mode, encoder=encoder, cut=cut)
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
        return query_streams.RankShards(
            {rank: query_streams.ArrayQueries(queries, order, num_shards=num_shards, shard_idx=rank,
                                              repeat_count=repeat_count) for rank in ranks.local_ranks()},
            fingerprint=dict(dataset=self.name, mode=mode, sha256=query_cache.sha256_rows(queries, order),
                             queries=len(order)))


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
