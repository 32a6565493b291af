"""Tests for lm_tasks.py: hparams, truncation/filter functions, query formatting and sampling."""
import pytest
import torch

from lm_human_preferences import lm_tasks
from lm_human_preferences.language import encodings
from lm_human_preferences.utils import hyperparams

PAD = 50259


def task(**overrides):
    hparams = lm_tasks.TaskHParams()
    hparams.override_from_dict(overrides)
    return hparams


def test_hparams_defaults_are_the_originals():
    h = lm_tasks.TaskHParams()
    assert (h.query_length, h.query_dataset, h.response_length) == (None, None, None)
    assert (h.query_prefix, h.query_suffix, h.start_text, h.end_text) == ('', '', '.', None)
    assert (h.truncate_token, h.truncate_after, h.penalty_reward_value) == (None, 0, -1)
    assert (h.policy.temperature, h.policy.initial_model) == (1.0, None)
    with pytest.raises(hyperparams.HParamTypeError, match='task.query_length'):
        h.validate(prefix='task.')


def test_truncation_example_of_the_original_tests():
    # test_train_policy.test_truncation: truncate_token 13, truncate_after 2.
    hparams = task(truncate_token=13, truncate_after=2)
    responses = torch.tensor([
        [13, 5, 13, 7, 13],  # first 13 at index >= 2 is index 2: keep it, pad after it
        [1, 13, 2, 3, 4],    # 13 only at index 1 < 2: untouched
        [1, 2, 3, 13, 13],   # first 13 at index 3: the 13 at index 4 becomes padding
        [1, 2, 3, 4, 5],     # no 13
    ])
    truncated = lm_tasks.postprocess_fn_from_hparams(hparams, PAD)(responses)
    assert truncated.tolist() == [
        [13, 5, 13, PAD, PAD],
        [1, 13, 2, 3, 4],
        [1, 2, 3, 13, PAD],
        [1, 2, 3, 4, 5],
    ]
    assert lm_tasks.filter_fn_from_hparams(hparams)(responses).tolist() == [True, False, True, False]


def test_truncate_after_zero_and_no_truncate_token():
    responses = torch.tensor([[13, 4, 13], [4, 4, 4]])
    assert lm_tasks.postprocess_fn_from_hparams(task(truncate_token=13), PAD)(responses).tolist() == [
        [13, PAD, PAD], [4, 4, 4]]
    hparams = task()
    assert torch.equal(lm_tasks.postprocess_fn_from_hparams(hparams, PAD)(responses), responses)
    keep = lm_tasks.filter_fn_from_hparams(hparams)(responses)
    assert keep.dtype == torch.bool and keep.tolist() == [True, True]


def test_query_formatter_adds_prefix_and_suffix_tokens():
    encoder = encodings.Test.get_encoder()
    format_queries = lm_tasks.query_formatter(task(query_prefix='ab', query_suffix='c'), encoder)
    queries = torch.tensor([[5, 6], [7, 27]])
    assert format_queries(queries).tolist() == [[0, 1, 5, 6, 2], [0, 1, 7, 27, 2]]
    assert torch.equal(lm_tasks.query_formatter(task(), encoder)(queries), queries)


def test_query_sampler_on_the_test_dataset():
    # The shapes of the original's test_train_policy hparams_for_test.
    hparams = task(query_length=2, response_length=3, query_dataset='test')
    encoder = encodings.Test.get_encoder()
    sampler = lm_tasks.make_query_sampler(hparams=hparams, encoder=encoder, batch_size=8)
    first, second = sampler()['tokens'], sampler()['tokens']
    assert first.shape == (8, 2) and first.dtype == torch.long
    assert not torch.equal(first, second)  # a fresh batch per call
    assert 0 <= int(first.min()) and int(first.max()) <= encoder.padding_token


def test_query_sampler_on_shipped_books():
    from lm_human_preferences.sentiment_mini import BOOKS_DIR
    encoder = encodings.Main.get_encoder()
    # launch.py's books_task.
    hparams = task(query_length=64, query_dataset=f'local:{BOOKS_DIR}', response_length=24,
                   start_text='.', end_text='.')
    batch = lm_tasks.make_query_sampler(hparams=hparams, encoder=encoder, batch_size=16, mode='test')()['tokens']
    assert batch.shape == (16, 64)
    for row in batch.tolist():
        text = encoder.decode(row)
        assert text.endswith('.') and len(text) > 20


def test_start_and_end_text_must_be_one_token():
    encoder = encodings.Test.get_encoder()
    with pytest.raises(ValueError, match=r"task.start_text='\.\.' must encode to exactly one token"):
        lm_tasks.make_query_sampler(hparams=task(query_length=4, query_dataset='test', start_text='..'),
                                    encoder=encoder, batch_size=2)
    with pytest.raises(ValueError, match='task.end_text'):
        lm_tasks.make_query_sampler(hparams=task(query_length=4, query_dataset='test', end_text='ab'),
                                    encoder=encoder, batch_size=2)
