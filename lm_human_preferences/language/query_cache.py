"""Ours: the prepared queries of a finite query dataset (language/datasets.py), computed once per (texts, encoding,
query settings) and saved as .npy under gcs.datasets_dir()/<name>/ (see datasets/README.md); later runs memory-map
them, so a batch costs one fancy-index. A split's texts are cached there too, so that a download and its clean-up
happen once."""

import hashlib
import io
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from lm_human_preferences.utils import core, files, gcs, ranks

# Part of every prepared file's key: bump it when the meaning of the prepared files changes.
_CACHE_VERSION = 1
# Encoded into the cache key, so that queries prepared with one encoding are never read with another.
_ENCODER_PROBE = ("Hello, World! The quick brown fox jumps over the lazy dog.\n\nTL;DR: it's 1,234 \u2014 "
                  "na\u00efve caf\u00e9 \u2018quoted\u2019 \u201cdouble\u201d\t  spaces\n")


def prepared_queries(dataset, mode, *, encoder, cut):
    """(queries [n_texts, sequence_length], valid [n_texts] bool, key) for all texts of the split in
    source order, from the cache or computed now (and cached); key identifies them (a hash of the
    texts, the encoding and the query settings)."""
    texts, texts_id = texts_and_id(dataset, mode)
    settings = dict(version=_CACHE_VERSION, dataset=dataset.name, mode=mode, texts_sha1=texts_id,
                    encoder_probe=encoder.encode(_ENCODER_PROBE), **cut.keywords)
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    base = os.path.join(gcs.datasets_dir(), dataset.cache_name, f'{mode}.queries-{key}')
    # Rank 0's process decides, so that every process takes the same branch (the downloads inside are
    # collective).
    if core.mpi_bcast(os.path.exists(base + '.npy')):
        return np.load(base + '.npy', mmap_mode='r'), np.load(base + '.valid.npy'), key

    # Every process encodes (a minute or two for the largest splits) instead of waiting for rank 0
    # inside a collective, which could time out; rank 0 alone writes the files.
    if texts is None:
        texts = _read_jsonl(texts_path(dataset, mode))
    queries, valid = _encode_queries(texts, encoder=encoder, cut=cut, desc=f'{dataset.name} {mode}: encoding queries')
    if ranks.is_root():
        os.makedirs(os.path.dirname(base), exist_ok=True)
        files.atomic_write(base + '.json', json.dumps(settings, indent=2).encode())
        files.atomic_write(base + '.valid.npy', _npy_bytes(valid))
        files.atomic_write(base + '.npy', _npy_bytes(queries))  # last: its presence marks completion
    return queries, valid, key


def texts_path(dataset, mode):
    return os.path.join(gcs.datasets_dir(), dataset.cache_name, f'{mode}.texts.jsonl')


def texts_and_id(dataset, mode):
    """(the split's texts, or None when they are cached and not loaded; sha1 of the texts)."""
    if not dataset.cache_texts:
        texts = dataset.texts(mode)
        return texts, _texts_sha1(texts)
    path = texts_path(dataset, mode)
    if core.mpi_bcast(os.path.exists(path)):
        with open(path + '.sha1') as f:
            return None, f.read().strip()
    texts = dataset.texts(mode)
    texts_id = _texts_sha1(texts)
    if ranks.is_root():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        files.atomic_write(path + '.sha1', texts_id.encode())
        # The original's book_passages format: one JSON string per line.
        files.atomic_write(path, b''.join(json.dumps(t).encode() + b'\n' for t in texts))
    return texts, texts_id


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
    bar = ranks.is_root() and sys.stderr.isatty()
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
    if ranks.is_root() and not bar:
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


def sha256_rows(array, order):
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
