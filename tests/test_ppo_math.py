"""The PPO math of train_policy.py against numbers computed independently with numpy.

The numpy references below are written from the original's formulas (train_policy.py's
compute_rewards, PPOTrainer.loss, the KL controllers), in a different form where that is natural
(GAE as an explicit discounted sum instead of the backward recursion).
"""
import numpy as np
import pytest
import torch

from lm_human_preferences import train_policy
from lm_human_preferences.train_policy import (
    AdaptiveKLController, AdaptiveKLParams, FixedKLController, compute_advantages, compute_rewards, ppo_loss)


def np_whiten(x, shift_mean=True):
    mean, var = x.mean(), x.var()  # population variance, as tf.nn.moments
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


def np_gae(rewards, values, gamma, lam):
    """A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0."""
    b, n = rewards.shape
    next_values = np.concatenate([values[:, 1:], np.zeros((b, 1))], axis=1)
    deltas = rewards + gamma * next_values - values
    adv = np.zeros_like(rewards)
    for t in range(n):
        for l in range(n - t):
            adv[:, t] += (gamma * lam) ** l * deltas[:, t + l]
    return adv


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_compute_rewards():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=4)
    logprobs, ref_logprobs = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    kl_coef = 0.37
    rewards, non_score_reward = compute_rewards(
        scores=t(scores), logprobs=t(logprobs), ref_logprobs=t(ref_logprobs), kl_coef=kl_coef)
    expected_nsr = -kl_coef * (logprobs - ref_logprobs)
    expected = expected_nsr.copy()
    expected[:, -1] += scores
    np.testing.assert_allclose(non_score_reward.numpy(), expected_nsr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rewards.numpy(), expected, rtol=1e-5, atol=1e-6)
    # The score only at the last token; the KL penalty is not modified in place.
    np.testing.assert_allclose((rewards - non_score_reward).numpy()[:, :-1], 0, atol=1e-6)


@pytest.mark.parametrize('whiten_rewards', [True, False])
@pytest.mark.parametrize('gamma,lam', [(1.0, 0.95), (0.9, 0.8)])
def test_compute_advantages(whiten_rewards, gamma, lam):
    rng = np.random.default_rng(1)
    rewards = rng.normal(loc=0.7, scale=2.0, size=(8, 5))
    values = rng.normal(size=(8, 5))
    advantages, returns = compute_advantages(
        rewards=t(rewards), values=t(values), gamma=gamma, lam=lam, whiten_rewards=whiten_rewards)

    r = np_whiten(rewards, shift_mean=False) if whiten_rewards else rewards
    if whiten_rewards:  # whitening keeps the mean, changes the scale
        assert abs(r.mean() - rewards.mean()) < 1e-9 and abs(r.std() - 1) < 1e-6
    adv = np_gae(r, values, gamma, lam)
    np.testing.assert_allclose(returns.numpy(), adv + values, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(advantages.numpy(), np_whiten(adv), rtol=1e-4, atol=1e-4)
    assert not advantages.requires_grad and not returns.requires_grad


def test_gae_last_token_next_value_is_zero():
    # One token, gamma = lam = 1: the advantage is just r - V (no bootstrap after the last token).
    advantages, returns = compute_advantages(
        rewards=t([[2.0], [3.0]]), values=t([[0.5], [1.0]]), gamma=1.0, lam=1.0, whiten_rewards=False)
    np.testing.assert_allclose(returns.numpy(), [[2.0], [3.0]])  # = r - V + V


def np_ppo_loss(*, logprob, vpred, old_logprob, old_values, advantages, returns, cliprange, cliprange_value,
                vf_coef):
    vpredclipped = np.clip(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf1, vf2 = (vpred - returns) ** 2, (vpredclipped - returns) ** 2
    vf_loss = 0.5 * np.maximum(vf1, vf2).mean()
    ratio = np.exp(logprob - old_logprob)
    pg1 = -advantages * ratio
    pg2 = -advantages * np.clip(ratio, 1 - cliprange, 1 + cliprange)
    pg_loss = np.maximum(pg1, pg2).mean()
    return dict(total=pg_loss + vf_coef * vf_loss, policy=pg_loss, value=vf_loss,
                pg_clipfrac=(pg2 > pg1).mean(), vf_clipfrac=(vf2 > vf1).mean(),
                approxkl=0.5 * ((logprob - old_logprob) ** 2).mean())


def test_ppo_loss_against_numpy():
    rng = np.random.default_rng(2)
    shape = (8, 6)
    old_logprob = rng.normal(-2, 1, size=shape)
    logprob = old_logprob + rng.normal(0, 0.4, size=shape)  # ratios well outside 1 +- 0.2 for many
    old_values = rng.normal(size=shape)
    vpred = old_values + rng.normal(0, 0.5, size=shape)  # some beyond +-cliprange_value
    advantages = rng.normal(size=shape)
    returns = rng.normal(size=shape)
    entropies = rng.uniform(0, 3, size=shape)
    kw = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    loss, stats = ppo_loss(logprob=t(logprob), vpred=t(vpred), entropies=t(entropies), old_logprob=t(old_logprob),
                           old_values=t(old_values), advantages=t(advantages), returns=t(returns), **kw)
    ref = np_ppo_loss(logprob=logprob, vpred=vpred, old_logprob=old_logprob, old_values=old_values,
                      advantages=advantages, returns=returns, **kw)
    assert 0 < ref['pg_clipfrac'] < 1 and 0 < ref['vf_clipfrac'] < 1  # the data exercises both clips
    np.testing.assert_allclose(loss.item(), ref['total'], rtol=1e-5)
    np.testing.assert_allclose(stats['loss/total'].item(), ref['total'], rtol=1e-5)
    np.testing.assert_allclose(stats['loss/policy'].item(), ref['policy'], rtol=1e-5)
    np.testing.assert_allclose(stats['loss/value'].item(), ref['value'], rtol=1e-5)
    np.testing.assert_allclose(stats['policy/clipfrac'].item(), ref['pg_clipfrac'], rtol=1e-6)
    np.testing.assert_allclose(stats['val/clipfrac'].item(), ref['vf_clipfrac'], rtol=1e-6)
    np.testing.assert_allclose(stats['policy/approxkl'].item(), ref['approxkl'], rtol=1e-5)
    np.testing.assert_allclose(stats['policy/entropy'].item(), entropies.mean(), rtol=1e-5)
    np.testing.assert_allclose(stats['val/vpred'].item(), vpred.mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats['val/error'].item(), ((vpred - returns) ** 2).mean(), rtol=1e-5)
    assert sorted(stats) == sorted([
        'loss/policy', 'loss/value', 'loss/total', 'policy/entropy', 'policy/approxkl', 'policy/clipfrac',
        'val/vpred', 'val/error', 'val/clipfrac'])
    # The stats that need no model, over the whole minibatch: val/mean and val/var are of the old values
    # (the rollout's), val/vpred (above) of the new predictions.
    moments = train_policy.minibatch_moments(returns=t(returns), old_values=t(old_values))
    np.testing.assert_allclose(moments['returns/mean'].item(), returns.mean(), rtol=1e-5)
    np.testing.assert_allclose(moments['returns/var'].item(), returns.var(), rtol=1e-5)
    np.testing.assert_allclose(moments['val/mean'].item(), old_values.mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(moments['val/var'].item(), old_values.var(), rtol=1e-5)
    assert sorted(moments) == ['returns/mean', 'returns/var', 'val/mean', 'val/var']


def test_ppo_loss_clip_fractions_are_strict_and_value_clip_is_around_old_values():
    # Ratios inside [0.8, 1.2] and vpred inside old_values +- 0.2: the clipped and unclipped terms are
    # equal, and equality is not counted as clipped (strict >).
    old_logprob = t([[-1.0, -2.0], [-0.5, -1.5]])
    logprob = old_logprob + t([[0.1, -0.1], [0.0, 0.05]])
    old_values = t([[1.0, 2.0], [3.0, 4.0]])
    vpred = old_values + 0.1
    common = dict(entropies=torch.zeros(2, 2), advantages=t([[1.0, -1.0], [0.5, -0.5]]), returns=t([[0.0, 0.0], [9.0, 9.0]]),
                  cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    _, stats = ppo_loss(logprob=logprob, vpred=vpred, old_logprob=old_logprob, old_values=old_values, **common)
    assert stats['policy/clipfrac'].item() == 0 and stats['val/clipfrac'].item() == 0

    # vpred far above the old values, returns below: the clipped prediction (old + 0.2) is closer to
    # the returns, so the max picks the unclipped error and the clip does not count... and the other
    # way round when the returns are above.
    vpred = old_values + 1.0
    _, below = ppo_loss(logprob=logprob, vpred=vpred, old_logprob=old_logprob, old_values=old_values,
                        **{**common, 'returns': old_values - 5})
    np.testing.assert_allclose(below['loss/value'].item(), 0.5 * 36.0, rtol=1e-6)
    assert below['val/clipfrac'].item() == 0
    _, above = ppo_loss(logprob=logprob, vpred=vpred, old_logprob=old_logprob, old_values=old_values,
                        **{**common, 'returns': old_values + 5})
    np.testing.assert_allclose(above['loss/value'].item(), 0.5 * 4.8 ** 2, rtol=1e-5)  # |old + 0.2 - (old + 5)|
    assert above['val/clipfrac'].item() == 1


def test_ppo_loss_gradient_stops_at_the_clip():
    # Positive advantage and ratio above 1 + cliprange: the clipped term wins, no policy gradient.
    old_logprob = torch.zeros(1, 2)
    logprob = t([[0.5, 0.05]]).requires_grad_()
    vpred = torch.zeros(1, 2, requires_grad=True)
    loss, _ = ppo_loss(logprob=logprob, vpred=vpred, entropies=torch.zeros(1, 2), old_logprob=old_logprob,
                       old_values=torch.zeros(1, 2), advantages=t([[1.0, 1.0]]), returns=torch.zeros(1, 2),
                       cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    loss.backward()
    # d/dlogp of mean(-A * exp(logp)) over 2 elements: -A * ratio / 2 for the unclipped one.
    np.testing.assert_allclose(logprob.grad.numpy(), [[0.0, -np.exp(0.05) / 2]], rtol=1e-5)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.15)
    ctl.update(100.0, 512)
    assert ctl.value == 0.15


@pytest.mark.parametrize('current,expected_error', [(9.0, 0.2), (6.6, 0.1), (6.0, 0.0), (4.8, -0.2), (0.0, -0.2)])
def test_adaptive_kl_controller(current, expected_error):
    ctl = AdaptiveKLController(0.15, hparams=AdaptiveKLParams(target=6.0, horizon=10000))
    ctl.update(current, 512)
    np.testing.assert_allclose(ctl.value, 0.15 * (1 + expected_error * 512 / 10000), rtol=1e-12)
    # It compounds over batches.
    ctl.update(current, 512)
    np.testing.assert_allclose(ctl.value, 0.15 * (1 + expected_error * 512 / 10000) ** 2, rtol=1e-12)


def test_adaptive_kl_accepts_a_tensor():
    ctl = AdaptiveKLController(0.2, hparams=AdaptiveKLParams(target=3.0, horizon=100))
    ctl.update(torch.tensor(3.3), 8)
    np.testing.assert_allclose(ctl.value, 0.2 * (1 + 0.1 * 8 / 100), rtol=1e-6)
    assert isinstance(ctl.value, float)


def test_nupdates_and_policy_frac():
    hparams = train_policy.HParams()
    hparams.ppo.total_episodes = 100
    hparams.ppo.batch_size = 16
    assert train_policy.nupdates(hparams) == 7  # ceil(100 / 16)
    assert train_policy.policy_frac(hparams, 0) == 0
    np.testing.assert_allclose(train_policy.policy_frac(hparams, 3), 3 / 7)
