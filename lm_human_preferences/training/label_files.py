"""Ours: the label files train_reward reads (the original's format, a JSON array of records): read, checked
record by record before any training (label_types.validate_labels), and identified for the run's save dir (their
fingerprint and where they came from), so that a rerun on other labels is refused; the records as tensors."""

import hashlib
import json
import os
from functools import partial

import numpy as np
import torch

from lm_human_preferences import label_types
from lm_human_preferences.utils import gcs, ranks


def read_labels(source, schemas, total_labels, *, n_vocab, padding_token):
    """The records of labels.source as the original's JSON holds them (lists of token ids, ints), each checked
    (check_records): an https URL or a local JSON file (read_records), or 'test': 50 records of zeros, as the
    original's download_labels made them (there, as numpy arrays)."""
    check = partial(check_records, schemas=schemas, total_labels=total_labels, n_vocab=n_vocab,
                    padding_token=padding_token)
    if source != 'test':
        results = read_records(source, check)  # a URL: downloaded once into the cache, by rank 0
        if ranks.is_root():
            print('Num labels found in source:', len(results))
        return results
    results = [{name: np.zeros(schema.shape, dtype=numpy_dtype(schema.dtype)).tolist()
                for name, schema in schemas.items()} for _ in range(50)]
    check(results, 'test labels')
    return results


def read_records(source, check):
    """The records of labels.source: an https URL (downloaded once into the cache, by rank 0) or a local JSON
    file, checked by check(records, where). A downloaded file is checked before it enters the cache (gcs's
    validate) and parsed once; a cached or local file is checked here."""
    if not gcs.is_url(source) and not os.path.isfile(source):
        raise ValueError(f'labels.source {source!r}: ' + (
            'a directory; expected an https URL or a JSON file of label records' if os.path.isdir(source) else
            'no such file; expected an https URL or a JSON file of label records'))
    parsed = []
    path = gcs.download_file_cached(source, validate=lambda tmp: parsed.append(load_records(tmp, source, check)))
    where = path if path == source else f'{source} (cached as {path})'
    return parsed[0] if parsed else load_records(path, where, check)


def load_records(path, where, check):
    """The records of the label file at path (named `where` in errors): a JSON array, then check(records,
    where). Every problem is a one-line ValueError."""
    try:
        with open(path) as f:
            results = json.load(f)
    except RecursionError:
        raise ValueError(f'label file {where} is nested too deeply to be label records (expected a JSON array '
                         f'of objects)') from None
    except json.JSONDecodeError as e:
        raise ValueError(f'label file {where} is not valid JSON: {e.msg} at line {e.lineno} '
                         f'column {e.colno} (char {e.pos})') from None
    except UnicodeDecodeError as e:
        raise ValueError(f'label file {where} is not UTF-8 text: byte {e.start} cannot be decoded') from None
    if not isinstance(results, list):
        raise ValueError(f'label file {where}: expected a JSON array of label records, '
                         f'got a JSON {type(results).__name__}')
    check(results, where)
    return results


def check_records(records, where, *, schemas, total_labels, n_vocab, padding_token):
    """Every record of a label file (named `where`) has the label type's schema, token ids in the vocabulary,
    and there are at least total_labels of them: a one-line ValueError naming the record and field."""
    # The original only asserted the count; a malformed record failed deep inside TF, or not at all.
    label_types.validate_labels(records, schemas, n_vocab=n_vocab, padding_token=padding_token, source=where)
    if len(records) < total_labels:
        raise ValueError(f'label file {where} has {len(records)} records, but labels.num_train is {total_labels}')


def numpy_dtype(torch_dtype):
    return torch.empty((), dtype=torch_dtype).numpy().dtype


def stack(records, schemas):
    """The records (checked) as train_reward's labels: a dict of name -> CPU tensor [n, *schema.shape] in the
    schema's dtype; None when there are none."""
    if not records:
        return None
    return {k: torch.from_numpy(np.asarray([r[k] for r in records], dtype=numpy_dtype(s.dtype)))
            for k, s in schemas.items()}


def label_source(source):
    """Ours: where a run's labels came from, for its save dir: a URL's download record (where the bytes
    came from, their size and sha256: see gcs.download_record), or a local file's path; None for 'test'."""
    if source == 'test':
        return None
    if gcs.is_url(source):
        return gcs.download_record(gcs.cached_path(source))
    return dict(path=os.path.abspath(source))


def label_fingerprint(train, held_out):
    """What identifies a run's labels: the sha256 of the records it read (train, then held out) and
    their number. The same records give the same fingerprint, wherever the file lives."""
    h = hashlib.sha256()
    for labels in (train, held_out):
        for k in sorted(labels or {}):
            h.update(k.encode() + labels[k].numpy().tobytes())
    count = sum(len(next(iter(labels.values()))) for labels in (train, held_out) if labels)
    return dict(sha256=h.hexdigest(), records=count)
