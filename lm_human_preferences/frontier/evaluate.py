"""Ours: one frontier point of a policy, by the offline experiments' report (offline/report.py: the labeler's gain in
standard deviations of the initial policy's scores, the reward model's accuracy on the initial and the trained
policy's samples) and the KL of the trained policy from the initial one, measured the same way for every arm; and
best-of-n's points. One process."""

import math

import numpy as np
import torch

from lm_human_preferences import lm_tasks
from lm_human_preferences.offline.labels import frozen_policy, rank_generator
from lm_human_preferences.offline.report import best_of_n_rows, reward_model_on_samples, sample_scores, score_report

KL_BATCH = 256  # queries sampled at a time for the KL


@torch.no_grad()
def measured_kl(exp, task, initial, trained, *, seed):
    """KL(trained || initial) in nats a response on exp.eval_queries test queries, as PPO's objective/kl: the sum over
    the sampled response's tokens (before the task's truncation) of log pi - log rho, both at the task's temperature;
    (mean, its standard error)."""
    policy, encoder = frozen_policy(trained, task)
    reference, _ = frozen_policy(initial, task)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=exp.eval_queries, mode='test')
    queries = sampler()['tokens']
    generator = rank_generator(seed)
    kls = []
    for start in range(0, len(queries), KL_BATCH):
        batch = queries[start:start + KL_BATCH]
        rollout = policy.respond(batch, task.response_length, generator=generator)
        reference_logprobs = reference.analyze_responses(batch, rollout['responses'])['logprobs']
        kls.append((rollout['logprobs'].float() - reference_logprobs.float()).sum(dim=1))
    kl = torch.cat(kls).double()
    return float(kl.mean()), float(kl.std() / math.sqrt(len(kl)))


def policy_point(exp, hparams, trained, run_dir, *, seed, report=None):
    """The frontier's columns of a trained policy (a model dir or Hugging Face folder) against
    hparams.task.policy.initial_model, with hparams.rewards.trained_model (or the online loop's last) as the reward
    model: from report, its run's report when it has one (the same functions, the same seed), else computed."""
    task = hparams.task
    if report is None:
        before, _ = sample_scores(exp, task.policy.initial_model, task, seed=seed)
        after, _ = sample_scores(exp, trained, task, seed=seed)
        report = dict(score_report(exp.labeler, before, after),
                      **reward_model_on_samples(exp, hparams, run_dir, seed=seed, trained=trained))
    kl, kl_se = measured_kl(exp, task, task.policy.initial_model, trained, seed=seed)
    key = exp.labeler.name
    return dict(gain=report[f'{key}_gain_initial_stds'], gain_se=report[f'{key}_gain_initial_stds_se'],
                kl=kl, kl_se=kl_se, kl_kind='measured', kl_objective=report.get('kl'),
                rm_initial=report['rm_accuracy_initial_samples'], rm_trained=report['rm_accuracy_trained_samples'])


def best_of_n_points(exp, hparams, ns, run_dir, *, queries, seed):
    """The frontier's points of best-of-n for each n in ns (powers of 2): the labeler's score of the sample the reward
    model ranks first among n of the initial policy, on `queries` test queries (report.best_of_n_rows), in standard
    deviations of the initial policy's scores there; its KL the bound log n - (n - 1) / n (best-of-n's KL from the
    initial policy is at most that, and close to it: Beirami et al. 2024); the reward model's accuracy on the
    initial policy's samples (its own are the initial policy's, filtered: not measured)."""
    rows, scores = best_of_n_rows(exp, hparams, n=max(ns), queries=queries, seed=seed)
    unit, start = float(scores.std(unbiased=False)), float(scores.mean())
    rm_initial = reward_model_on_samples(exp, hparams, run_dir, seed=seed,
                                         trained=hparams.task.policy.initial_model)['rm_accuracy_initial_samples']
    by_k = {row['k']: row for row in rows}
    return [dict(value=n, gain=(by_k[n]['reward_model_pick'] - start) / unit,
                 gain_se=by_k[n]['reward_model_pick_std'] / unit / math.sqrt(queries),
                 kl=float(np.log(n) - (n - 1) / n), kl_se=0.0, kl_kind='bound', kl_objective=None,
                 rm_initial=rm_initial, rm_trained=None)
            for n in ns]
