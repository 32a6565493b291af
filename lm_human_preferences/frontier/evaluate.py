"""Ours: one frontier point of a policy, by the offline experiments' report (offline/report.py: the labeler's gain in
standard deviations of the initial policy's scores, the reward model's accuracy on the initial and the trained
policy's samples) and the KL of the trained policy from the initial one, measured the same way for every arm; and
best-of-n's points. Every arm's gain is against one baseline a seed (seed_baseline: the initial policy's scores on
the test queries, computed once and stored). One process."""

import dataclasses
import json
import math
import os

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from lm_human_preferences import lm_tasks
from lm_human_preferences.offline.labels import frozen_policy, rank_generator
from lm_human_preferences.offline.report import (best_of_n_rows, best_of_n_samples, reward_model_on_samples,
                                                 sample_scores, score_report)
from lm_human_preferences.utils import files

KL_BATCH = 256  # queries sampled at a time for the KL
# Best-of-n: every n up to this on all the test queries; a larger n on a prefix of them with as many samples (n x
# queries) in all, so that its last points cost what the first do.
ALL_QUERIES_MAX_N = 256


@torch.no_grad()
def measured_kl(exp, task, initial, trained, *, seed):
    """KL(trained || initial) in nats a response on exp.eval_queries test queries, as PPO's objective/kl: the sum over
    the sampled response's tokens (before the task's truncation) of log pi - log rho, both at the task's temperature;
    (mean, its standard error, the share of those samples that pass the task's filter once postprocessed, as PPO's
    score judges them)."""
    policy, encoder = frozen_policy(trained, task)
    reference, _ = frozen_policy(initial, task)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=exp.eval_queries, mode='test')
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)
    passes = lm_tasks.filter_fn_from_hparams(dataclasses.replace(task, filter_responses=True))
    queries = sampler()['tokens']
    generator = rank_generator(seed)
    kls, passed = [], []
    for start in range(0, len(queries), KL_BATCH):
        batch = queries[start:start + KL_BATCH]
        rollout = policy.respond(batch, task.response_length, generator=generator)
        reference_logprobs = reference.analyze_responses(batch, rollout['responses'])['logprobs']
        kls.append((rollout['logprobs'].float() - reference_logprobs.float()).sum(dim=1))
        passed.append(passes(postprocess(rollout['responses'])))
    kl = torch.cat(kls).double()
    return float(kl.mean()), float(kl.std() / math.sqrt(len(kl))), float(torch.cat(passed).float().mean())


def seed_baseline(exp, task, *, seed):
    """The initial policy's scores by the labeler on exp.eval_queries test queries (one response each, sampled as the
    report samples: sample_scores, the seed's stream), the unit and origin of every arm's gain on this seed:
    {scores, mean, std, queries}."""
    scores, _ = sample_scores(exp, task.policy.initial_model, task, seed=seed)
    return dict(scores=scores.tolist(), mean=float(scores.mean()), std=float(scores.std(unbiased=False)),
                queries=len(scores))


def policy_point(exp, hparams, trained, run_dir, *, seed, baseline, report=None):
    """The frontier's columns of a trained policy (a model dir or Hugging Face folder) against
    hparams.task.policy.initial_model, with hparams.rewards.trained_model (or the online loop's last) as the reward
    model: the labeler's gain over the seed's baseline (seed_baseline) in its standard deviations, as the report's
    score_report computes it; the reward model's accuracies from report, its run's report when it has one (the same
    functions, the same seed), else computed."""
    task = hparams.task
    after, _ = sample_scores(exp, trained, task, seed=seed)
    scored = score_report(exp.labeler, torch.tensor(baseline['scores'], dtype=torch.float64), after)
    if report is None:
        report = reward_model_on_samples(exp, hparams, run_dir, seed=seed, trained=trained)
    kl, kl_se, filter_pass = measured_kl(exp, task, task.policy.initial_model, trained, seed=seed)
    key = exp.labeler.name
    return dict(gain=scored[f'{key}_gain_initial_stds'], gain_se=scored[f'{key}_gain_initial_stds_se'],
                trained_mean=scored[f'{key}_trained_mean'], filter_pass=filter_pass, kl=kl, kl_se=kl_se,
                kl_kind='measured',
                kl_objective=report.get('kl'), rm_initial=report['rm_accuracy_initial_samples'],
                rm_trained=report['rm_accuracy_trained_samples'])


def kept_best_of_n_samples(exp, task, *, n, queries, seed, samples_dir, identity):
    """report.best_of_n_samples, drawn once and kept in samples_dir/n<n>-queries<q>.safetensors with `identity` (what
    they depend on: the experiment, the seed, the initial model's weights) and the task in its header; read back by
    every later best-of-n run of the seed, so the label axis ranks the same samples by each reward model (scoring
    them takes about a fifth of drawing them: sweep.BEST_OF_N_RANKING_SHARE). A file of another identity is refused
    in one line."""
    path = os.path.join(samples_dir, f'n{n}-queries{queries}.safetensors')
    task_fields = task.to_nested_dict()  # as labels.labels_key names a task
    task_fields['policy'].pop('initial_model')  # the weights' sha256 in identity stands for it, wherever it lies
    header = json.dumps(dict(identity, task=task_fields, n=n, queries=queries), sort_keys=True)
    if os.path.isfile(path):
        with safe_open(path, 'pt') as f:
            if f.metadata().get('identity') != header:
                raise ValueError(f'{path} holds best-of-n samples of other settings ({f.metadata().get("identity")}; '
                                 f'this run: {header}): remove it to draw them again')
            return {name: f.get_tensor(name) for name in f.keys()}
    samples = best_of_n_samples(exp, task, n=n, queries=queries, seed=seed)
    os.makedirs(samples_dir, exist_ok=True)
    files.atomic_write(path, save({k: v.contiguous() for k, v in samples.items()}, metadata=dict(identity=header)))
    return samples


def best_of_n_points(exp, hparams, ns, run_dir, *, queries, seed, baseline, samples_dir=None, identity=None):
    """The frontier's points of best-of-n for each n in ns (powers of 2): the labeler's score of the sample that PPO's
    score ranks first among n of the initial policy (report.best_of_n_rows's ppo_score: the reward model's score, the
    task's penalty for a sample that fails its filter, as PPO maximizes), less the mean of all the initial policy's
    samples of the same queries, in the seed's baseline's standard deviations. n up to ALL_QUERIES_MAX_N on `queries`
    test queries (the other arms' 1,024), a larger n on the first queries x ALL_QUERIES_MAX_N / n of them (as many
    samples). Its KL the bound log n - (n - 1) / n (best-of-n's KL from the initial policy is at most that, and close
    to it: Beirami et al. 2024); the reward model's accuracy on the initial policy's samples (its own are the initial
    policy's, filtered: not measured). With samples_dir, its samples are kept there and read back
    (kept_best_of_n_samples)."""
    unit = baseline['std']
    rm_initial = reward_model_on_samples(exp, hparams, run_dir, seed=seed,
                                         trained=hparams.task.policy.initial_model)['rm_accuracy_initial_samples']
    tiers = [[n for n in ns if n <= ALL_QUERIES_MAX_N], [n for n in ns if n > ALL_QUERIES_MAX_N]]
    points = []
    for tier in tiers:
        if not tier:
            continue
        tier_queries = max(1, queries * ALL_QUERIES_MAX_N // max(tier)) if max(tier) > ALL_QUERIES_MAX_N else queries
        samples = None if samples_dir is None else kept_best_of_n_samples(
            exp, hparams.task, n=max(tier), queries=tier_queries, seed=seed, samples_dir=samples_dir,
            identity=identity)
        rows, scores = best_of_n_rows(exp, hparams, n=max(tier), queries=tier_queries, seed=seed, samples=samples)
        start = float(scores.mean())  # best-of-1 on these queries: the initial policy's mean there
        by_k = {row['k']: row for row in rows}
        points += [dict(value=n, gain=(by_k[n]['ppo_score_pick'] - start) / unit,
                        gain_se=by_k[n]['ppo_score_pick_std'] / unit / math.sqrt(tier_queries), queries=tier_queries,
                        samples=n * tier_queries, optimizer_steps=0,
                        kl=float(np.log(n) - (n - 1) / n), kl_se=0.0, kl_kind='bound', kl_objective=None,
                        rm_initial=rm_initial, rm_trained=None)
                   for n in tier]
    return points
