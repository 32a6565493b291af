"""Tests for label_types.py: schemas, losses (hand-computed) and validate_labels."""
import math

import numpy as np
import pytest
import torch

from lm_human_preferences import label_types

N_VOCAB, PAD = 50257, 50259


def reward_sum(queries, responses):
    """A stand-in reward model: the sum of the response tokens."""
    return responses.float().sum(dim=1)


def test_get_and_schemas():
    best = label_types.get('best_of_4')
    assert isinstance(best, label_types.PickBest) and best.num_responses == 4
    schemas = best.question_schemas(query_length=64, response_length=24)
    assert list(schemas) == ['query', 'sample0', 'sample1', 'sample2', 'sample3']
    assert schemas['query'].shape == (64,) and schemas['sample3'].shape == (24,)
    assert all(s.dtype == torch.int32 for s in schemas.values())
    assert best.label_schemas()['best'].dtype == torch.int32 and best.label_schemas()['best'].shape == ()
    assert isinstance(label_types.get('scalar_rating'), label_types.ScalarRating)
    assert label_types.get('scalar_rating').label_schemas()['score'].dtype == torch.float32
    assert list(label_types.get('scalar_compare').question_schemas(query_length=2, response_length=3)) == [
        'query', 'sample0', 'sample1']
    for bad in ('best_of', 'best_of_x', 'best_of_1', 'pairwise'):
        with pytest.raises(ValueError, match=rf"^unknown label type '{bad}': expected best_of_<N> \(N >= 2\), "
                                             r"scalar_rating or scalar_compare$"):
            label_types.get(bad)


def test_pick_best_loss_is_softmax_cross_entropy():
    labels = dict(
        query=torch.zeros(2, 3, dtype=torch.int32),
        sample0=torch.tensor([[1, 0], [0, 0]], dtype=torch.int32),  # rewards row 0: 1, 0, 2; row 1: 0, 3, 1
        sample1=torch.tensor([[0, 0], [1, 2]], dtype=torch.int32),
        sample2=torch.tensor([[1, 1], [1, 0]], dtype=torch.int32),
        best=torch.tensor([2, 0], dtype=torch.int32),
    )
    stats = label_types.PickBest(3).loss(reward_sum, labels)
    e = math.exp
    want = (-math.log(e(2) / (e(1) + e(0) + e(2))) - math.log(e(0) / (e(0) + e(3) + e(1)))) / 2
    assert set(stats) == {'loss', 'error'}
    assert stats['loss'].item() == pytest.approx(want, rel=1e-6)
    assert label_types.PickBest(3).target_scales(labels) is None


def test_pick_best_loss_backpropagates_into_the_reward_model():
    scale = torch.tensor(0.5, requires_grad=True)
    labels = dict(query=torch.zeros(1, 1, dtype=torch.int32), best=torch.tensor([1], dtype=torch.int32),
                  sample0=torch.tensor([[1]], dtype=torch.int32), sample1=torch.tensor([[3]], dtype=torch.int32))
    label_types.PickBest(2).loss(lambda q, r: scale * reward_sum(q, r), labels)['loss'].backward()
    # loss = -log softmax(s*[1, 3])[1]; d/ds = 3*p1 + 1*p0 - 3 with p = softmax([0.5, 1.5]).
    p0 = 1 / (1 + math.exp(1))
    assert scale.grad.item() == pytest.approx(p0 * 1 + (1 - p0) * 3 - 3, rel=1e-5)


def test_scalar_rating_loss_and_stats():
    labels = dict(query=torch.zeros(4, 1, dtype=torch.int32),
                  sample=torch.tensor([[1], [2], [3], [5]], dtype=torch.int32),
                  score=torch.tensor([1.0, 3.0, 2.0, 6.0]))
    stats = label_types.ScalarRating().loss(reward_sum, labels)
    pred, score = np.array([1, 2, 3, 5.0]), np.array([1, 3, 2, 6.0])
    assert stats['loss'].item() == pytest.approx(np.mean((score - pred) ** 2))
    assert stats['error'].item() == stats['loss'].item()
    assert stats['label_mean'].item() == pytest.approx(3.0)
    assert stats['label_var'].item() == pytest.approx(np.var(score))  # population variance: 3.5
    assert stats['corr'].item() == pytest.approx(np.corrcoef(score, pred)[0, 1], rel=1e-5)
    assert torch.equal(label_types.ScalarRating().target_scales(labels), labels['score'])


def test_scalar_comparison_loss_and_target_scales():
    labels = dict(query=torch.zeros(2, 1, dtype=torch.int32),
                  sample0=torch.tensor([[1], [4]], dtype=torch.int32),
                  sample1=torch.tensor([[3], [4]], dtype=torch.int32),
                  difference=torch.tensor([1.0, -1.0]))
    stats = label_types.ScalarComparison().loss(reward_sum, labels)
    # predicted differences r1 - r0: 2, 0; errors (1-2)^2, (-1-0)^2
    assert stats['loss'].item() == pytest.approx(1.0) and set(stats) == {'loss', 'error'}
    assert label_types.ScalarComparison().target_scales(labels).tolist() == [0.5, -0.5]


# ---------------------------------------------------------------------------------------------------
# validate_labels

def schemas(label_type='best_of_4', query_length=3, response_length=2):
    t = label_types.get(label_type)
    return {**t.question_schemas(query_length=query_length, response_length=response_length), **t.label_schemas()}


def good_record(**changes):
    record = dict(query=[10, 20, PAD], sample0=[1, 2], sample1=[3, PAD], sample2=[0, N_VOCAB - 1], sample3=[5, 6],
                  best=3, broken=False)  # extra keys are allowed
    record.update(changes)
    return record


def validate(records, label_type='best_of_4'):
    label_types.validate_labels(records, schemas(label_type), n_vocab=N_VOCAB, padding_token=PAD,
                                source='labels.json')


def test_validate_accepts_good_records():
    validate([good_record(), good_record(best=0)])
    validate([dict(query=[1, 2, 3], sample=[4, 5], score=0.5), dict(query=[1, 2, 3], sample=[4, 5], score=-2)],
             'scalar_rating')
    validate([dict(query=[1, 2, 3], sample0=[4, 5], sample1=[4, 5], difference=1.5)], 'scalar_compare')
    # numpy values, as the original's 'test' label source makes them (zeros).
    s = schemas()
    zeros = {name: np.zeros(schema.shape, dtype=np.int32) for name, schema in s.items()}
    label_types.validate_labels([zeros], s, n_vocab=N_VOCAB, padding_token=PAD, source='test')
    validate([])


@pytest.mark.parametrize('records, message', [
    ({'query': []}, "labels.json: expected a list of label records, got dict"),
    ('[]', "labels.json: expected a list of label records, got str"),
    ([good_record(), [1, 2]], "labels.json record 1: expected an object with keys .* got list"),
    ([{k: v for k, v in good_record().items() if k != 'sample2'}], "labels.json record 0: missing key 'sample2'"),
    ([good_record(), good_record(sample2=[1])], "labels.json record 1: 'sample2' has 1 tokens, expected response_length 2"),
    ([good_record(query=[1, 2, 3, 4])], "labels.json record 0: 'query' has 4 tokens, expected query_length 3"),
    ([good_record(query=7)], "labels.json record 0: 'query' is int, expected a list of 3 token ids"),
    ([good_record(sample1=[1, True])], r"labels.json record 0: 'sample1' token 1 is True \(bool\), expected an integer"),
    ([good_record(sample1=[1.0, 2])], r"labels.json record 0: 'sample1' token 0 is 1.0 \(float\)"),
    ([good_record(sample1=['a', 2])], r"labels.json record 0: 'sample1' token 0 is 'a' \(str\)"),
    ([good_record(sample0=[N_VOCAB, 1])], rf"'sample0' token 0 is {N_VOCAB}, outside the vocabulary \[0, {N_VOCAB}\) "
                                          rf"and not the padding token {PAD}"),
    ([good_record(sample0=[1, -1])], "'sample0' token 1 is -1, outside the vocabulary"),
    ([good_record(sample0=[1, 2 ** 70])], f"'sample0' token 1 is {2 ** 70}, outside the vocabulary"),
    ([good_record(query=np.array([1.0, 2.0, 3.0]))], "'query' is an array of float64 with shape"),
    ([good_record(best=4)], r"labels.json record 0: 'best' is 4, expected an integer in \[0, 4\)"),
    ([good_record(best=-1)], r"'best' is -1, expected an integer in \[0, 4\)"),
    ([good_record(best=True)], r"'best' is True, expected an integer"),
    ([good_record(best=1.0)], r"'best' is 1.0, expected an integer"),
    ([good_record(best='1')], r"'best' is '1', expected an integer"),
])
def test_validate_rejects_malformed_best_of_4(records, message):
    with pytest.raises(ValueError, match=message) as e:
        validate(records)
    assert '\n' not in str(e.value)


@pytest.mark.parametrize('score, message', [
    ('0.5', "'score' is '0.5', expected a finite number"),
    (None, "'score' is None, expected a finite number"),
    (True, "'score' is True, expected a finite number"),
    (float('nan'), "'score' is nan, expected a finite number"),
    (float('inf'), "'score' is inf, expected a finite number"),
])
def test_validate_rejects_malformed_scores(score, message):
    with pytest.raises(ValueError, match=f'labels.json record 0: {message}'):
        validate([dict(query=[1, 2, 3], sample=[4, 5], score=score)], 'scalar_rating')
