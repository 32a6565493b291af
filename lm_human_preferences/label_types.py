"""Interface and implementations of label types for a reward model."""

import math
import numbers
from abc import ABC, abstractmethod
from typing import Optional, Dict

import numpy as np
import torch
import torch.nn.functional as F

from lm_human_preferences.utils.core import Schema, pearson_r


class LabelType(ABC):
    @abstractmethod
    def label_schemas(self) -> Dict[str, Schema]:
        """Schema for the human annotations."""

    @abstractmethod
    def target_scales(self, labels: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """Extracts scalars out of labels whose scale corresponds to the reward model's output.
           May be none if the labels have no such information."""

    @abstractmethod
    def loss(self, reward_model, labels: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """
        :param reward_model: reward_model(queries, responses) -> rewards [batch]
        :param labels: the questions with their labels
        :returns: a dict of stats, including 'loss' for the actual loss
        """

    @abstractmethod
    def question_schemas(self, *, query_length, response_length) -> Dict[str, Schema]:
        """Schema for the questions associated with this LabelType."""


class PickBest(LabelType):
    """Pick best response amongst N."""
    def __init__(self, num_responses):
        self.num_responses = num_responses

    def label_schemas(self):
        return dict(best=Schema(torch.int32, ()))

    def target_scales(self, labels):
        return None

    def loss(self, reward_model, labels):
        logits = torch.stack([reward_model(labels['query'], labels[f'sample{i}'])
                              for i in range(self.num_responses)], dim=1)
        # tf.nn.sparse_softmax_cross_entropy_with_logits, then the mean: torch wants int64 class labels.
        error = F.cross_entropy(logits, labels['best'].long())
        # `error` is the original's second name for the loss (every label type returns both): the stats
        # table, TensorBoard and the stats JSONL show both, as the original's did, so that logs compare.
        return dict(loss=error, error=error)

    def question_schemas(self, *, query_length, response_length) -> Dict[str, Schema]:
        return dict(
            query=Schema(torch.int32, (query_length,)),
            **{f"sample{i}": Schema(torch.int32, (response_length,)) for i in range(self.num_responses)}
        )


class ScalarRating(LabelType):
    """Rate a single number with a scalar score."""
    def __init__(self):
        pass

    def label_schemas(self):
        return dict(
            score=Schema(torch.float32, ()))

    def target_scales(self, labels):
        return labels['score']

    def loss(self, reward_model, labels):
        predicted = reward_model(labels['query'], labels['sample'])
        labels = labels['score']
        error = torch.mean((labels - predicted) ** 2, dim=0)
        # tf.nn.moments: the population variance.
        label_mean, label_var = torch.mean(labels, dim=0), torch.var(labels, dim=0, unbiased=False)
        corr = pearson_r(labels, predicted)
        return dict(loss=error, error=error,
                    label_mean=label_mean, label_var=label_var, corr=corr)

    def question_schemas(self, *, query_length, response_length) -> Dict[str, Schema]:
        return dict(
            query=Schema(torch.int32, (query_length,)),
            sample=Schema(torch.int32, (response_length,)),
        )


class ScalarComparison(LabelType):
    """Give a scalar indicating difference between two responses."""
    def label_schemas(self):
        return dict(difference=Schema(torch.float32, ()))

    def target_scales(self, labels):
        # Divide by two to get something with the same variance as the trained reward model output
        return labels['difference']/2

    def loss(self, reward_model, labels):
        outputs0 = reward_model(labels['query'], labels['sample0'])
        outputs1 = reward_model(labels['query'], labels['sample1'])

        differences = labels['difference']
        predicted_differences = outputs1 - outputs0
        error = torch.mean((differences - predicted_differences)**2, dim=0)
        return dict(loss=error, error=error)

    def question_schemas(self, *, query_length, response_length) -> Dict[str, Schema]:
        return dict(
            query=Schema(torch.int32, (query_length,)),
            sample0=Schema(torch.int32, (response_length,)),
            sample1=Schema(torch.int32, (response_length,)),
        )


def get(label_type: str) -> LabelType:
    if label_type == 'scalar_rating':
        return ScalarRating()
    if label_type == 'scalar_compare':
        return ScalarComparison()
    n = label_type[len('best_of_'):]
    if label_type.startswith('best_of_') and n.isdigit() and int(n) >= 2:
        return PickBest(int(n))
    # The original: int() failed on best_of_x, and any other name was "Unexpected label type".
    raise ValueError(f"unknown label type {label_type!r}: expected best_of_<N> (N >= 2), scalar_rating or "
                     f"scalar_compare")


def validate_labels(records, schemas: Dict[str, Schema], *, n_vocab, padding_token, source):
    """Check label records against the label type's schemas (question_schemas + label_schemas) before
    training (no original: TF failed later, or not at all, on a malformed file).

    Token fields: a list of exactly schema.shape[0] integers, each in [0, n_vocab) or == padding_token.
    `best`: an integer in [0, N) for the N `sample<i>` fields. Float fields: a finite number. Extra keys
    are allowed. Raises a one-line ValueError naming source, record index and field.
    """
    if not isinstance(records, (list, tuple)):
        raise ValueError(f'{source}: expected a list of label records, got {type(records).__name__}')
    num_samples = sum(1 for k in schemas if k.startswith('sample') and k[len('sample'):].isdigit())
    for i, record in enumerate(records):
        where = f'{source} record {i}'
        if not isinstance(record, dict):
            raise ValueError(f'{where}: expected an object with keys {sorted(schemas)}, got {type(record).__name__}')
        for name, schema in schemas.items():
            if name not in record:
                raise ValueError(f"{where}: missing key '{name}' (expected keys {sorted(schemas)})")
            value = record[name]
            if isinstance(value, np.ndarray) and value.ndim == 0:
                value = value.item()  # a 0-d array (the 'test' label source's zeros) as a Python scalar
            if len(schema.shape) == 1:
                _check_tokens(value, schema.shape[0], where=where, name=name, n_vocab=n_vocab,
                              padding_token=padding_token)
            elif schema.dtype.is_floating_point:
                if not _is_number(value) or not math.isfinite(value):
                    raise ValueError(f"{where}: '{name}' is {value!r}, expected a finite number")
            elif name == 'best':
                if not _is_int(value) or not 0 <= value < num_samples:
                    raise ValueError(f"{where}: 'best' is {value!r}, expected an integer in [0, {num_samples})")
            elif not _is_int(value):
                raise ValueError(f"{where}: '{name}' is {value!r}, expected an integer")


def _is_int(v):
    # bool is an int subclass in Python, but True is no token id or sample index.
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _check_tokens(value, length, *, where, name, n_vocab, padding_token):
    what = 'query_length' if name == 'query' else 'response_length'
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in 'iu':
            raise ValueError(f"{where}: '{name}' is an array of {value.dtype} with shape {value.shape}, "
                             f"expected {length} integer token ids")
        tokens = value
    else:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: '{name}' is {type(value).__name__}, expected a list of {length} token ids")
        # One C-speed pass over the element types first: tens of millions of tokens in a big label file.
        if not set(map(type, value)) <= {int}:
            for j, t in enumerate(value):
                if not _is_int(t):
                    raise ValueError(f"{where}: '{name}' token {j} is {t!r} ({type(t).__name__}), "
                                     f"expected an integer token id")
        try:
            tokens = np.asarray(value, dtype=np.int64)
        except OverflowError:  # an int beyond int64: out of the vocabulary, shown as it is
            j = next(j for j, t in enumerate(value) if not -2 ** 63 <= t < 2 ** 63)
            raise ValueError(f"{where}: '{name}' token {j} is {value[j]}, outside the vocabulary [0, {n_vocab}) "
                             f"and not the padding token {padding_token}") from None
    if len(tokens) != length:
        raise ValueError(f"{where}: '{name}' has {len(tokens)} tokens, expected {what} {length}")
    bad = (tokens < 0) | ((tokens >= n_vocab) & (tokens != padding_token))
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: '{name}' token {j} is {int(tokens[j])}, outside the vocabulary "
                         f"[0, {n_vocab}) and not the padding token {padding_token}")
