"""sample_sequence() tests: the original's test_sample.py case, plus temperature, top-k/p, extras and
the policy's sampling against its own analysis."""

import numpy as np
import pytest
import torch

from lm_human_preferences.language import sample, trained_models
from lm_human_preferences.policy import Policy

n_vocab = 10
batch_size = 2
hparams = None  # the step functions below ignore the model hparams


# Returns a policy that deterministically chooses previous token + 1.
def step(hparams, tokens, past=None, past_tokens=None):
    logits = torch.full(tokens.shape + (n_vocab,), -np.inf)
    logits.scatter_(-1, (tokens + 1)[..., None], 0.0)
    if past is not None:
        assert torch.equal(past_tokens, past['tokens'])  # past_tokens are the tokens before `tokens`
    seen = tokens if past is None else torch.cat([past['tokens'], tokens], dim=1)
    return {'logits': logits, 'presents': {'tokens': seen}, 'position': torch.full(tokens.shape, float(seen.shape[1]))}


def test_sample_sequence():
    output = sample.sample_sequence(step=step, model_hparams=hparams, length=4,
                                    context=torch.tensor([[5, 0], [4, 3]]))
    expected = np.array([[5, 0, 1, 2, 3, 4], [4, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(output['tokens'].numpy(), expected)
    np.testing.assert_array_equal(output['logprobs'].numpy(), np.zeros([2, 4]))


def test_length_and_extras():
    """Exactly `length` tokens; extra output i comes from the position that predicted token i."""
    out = sample.sample_sequence(step=step, model_hparams=hparams, length=3,
                                 context=torch.tensor([[1, 2, 3], [4, 5, 6]]), extra_outputs=('position',))
    assert out['tokens'].shape == (2, 6) and out['logprobs'].shape == (2, 3)
    np.testing.assert_array_equal(out['position'].numpy(), [[3, 4, 5], [3, 4, 5]])
    with pytest.raises(ValueError, match='length must be >= 1'):
        sample.sample_sequence(step=step, model_hparams=hparams, length=0, context=torch.tensor([[1]]))


def _fixed_step(logits_row):
    """A step whose logits are the same at every position."""
    def f(hparams, tokens, past=None, past_tokens=None):
        return {'logits': logits_row.expand(tokens.shape + logits_row.shape), 'presents': None}
    return f


def test_temperature_top_k_top_p_logprobs():
    """logprobs are those of the tempered logits (1/T scaling), filtered by top_k / top_p on every step
    but the first (as the original); top_k=1 samples the argmax."""
    logits_row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0, 0.1, 0.2, 0.3])
    T = 0.7
    ctx = torch.zeros(64, 1, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=4, context=ctx,
                                 temperature=T, top_k=1, generator=g)
    first = out['tokens'][:, 1]
    expected_first = torch.log_softmax(logits_row * (1 / T), -1)[first]
    torch.testing.assert_close(out['logprobs'][:, 0], expected_first)
    assert len(set(first.tolist())) > 1  # the first token is not top-k filtered
    assert torch.all(out['tokens'][:, 2:] == 5)
    torch.testing.assert_close(out['logprobs'][:, 1:], torch.zeros(64, 3))

    # top_p = 0.75 keeps the tokens whose cumulative probability (sorted) is <= 0.75: 0.54, 0.74 -> two
    out = sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=3, context=ctx,
                                 temperature=1.0, top_p=0.75, generator=g)
    later = out['tokens'][:, 2:]
    assert set(later.flatten().tolist()) <= {0, 5} and len(set(later.flatten().tolist())) == 2
    kept = torch.log_softmax(logits_row[[0, 5]], -1)
    for tok, lp in zip(later.flatten().tolist(), out['logprobs'][:, 1:].flatten().tolist()):
        assert abs(lp - kept[0 if tok == 0 else 1].item()) < 1e-5

    # temperature 0 -> 1/1e-10: greedy
    out = sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=2, context=ctx,
                                 temperature=0.0)
    assert torch.all(out['tokens'][:, 1:] == 5)


def test_generator_reproducible():
    logits_row = torch.zeros(n_vocab)
    ctx = torch.zeros(8, 1, dtype=torch.long)
    runs = [sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=6, context=ctx,
                                   generator=torch.Generator().manual_seed(seed))['tokens'] for seed in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_policy_respond_matches_analyze_responses():
    """Sampling with the KV cache (queries padded inside and at the end) gives the logprobs and values
    that a full forward of query + response gives, at temperature 0.7."""
    torch.manual_seed(0)
    policy = Policy(trained_models.TrainedModel('test'), temperature=0.7)
    with torch.no_grad():
        policy.model.heads.value.w.normal_()  # the value head starts at zero
    pad = policy.padding_token
    queries = torch.tensor([[3, 4, pad, pad], [5, pad, 6, 7], [8, 9, 10, pad], [1, 2, 3, 4]])
    r = policy.respond(queries, length=4, generator=torch.Generator().manual_seed(3))
    assert r['responses'].shape == (4, 4) and torch.all(r['responses'] < 27)
    a = policy.analyze_responses(queries, r['responses'])
    torch.testing.assert_close(r['logprobs'], a['logprobs'], atol=1e-5, rtol=0)
    torch.testing.assert_close(r['values'], a['values'], atol=1e-5, rtol=0)
    assert torch.all(a['entropies'] > 0)
