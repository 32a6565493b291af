"""Ours: an offline experiment's labels. For each query of the task's dataset the initial policy samples N
responses at the task's temperature and the experiment's labeler picks the best: the highest score of the
(postprocessed) responses, ties broken at random (seeded). Written in the original's best_of_N JSON format
({query, sample0..N-1, best}, token ids), which train_reward reads back through its normal label path.

The labels are data, as the original's human labels were (made once, downloaded by every run): kept in
datasets_dir()/<experiment>_labels/, keyed by all they depend on (labels_key), so that a rerun of the same seed
reuses them as it reuses the seed's initial model."""

import hashlib
import json
import os

import numpy as np
import torch

from lm_human_preferences import label_types, lm_tasks
from lm_human_preferences import train_reward as train_reward_module
from lm_human_preferences.labeling.programs import label_best
from lm_human_preferences.labeling.questions import sample_responses
from lm_human_preferences.language import trained_models, vocab_sampling
from lm_human_preferences.policy import Policy
from lm_human_preferences.training import memory, reward_evaluation
from lm_human_preferences.training.execution import Execution
from lm_human_preferences.training.progress import Progress
from lm_human_preferences.utils import distributed, ranks
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files, gcs


def frozen_policy(model_name, task):
    """A frozen Policy of the named model (a name or dir, as task.policy.initial_model) for the task."""
    m = trained_models.TrainedModel(model_name)
    policy = Policy.for_task(m, task).to(utils.get_device())
    policy.requires_grad_(False)
    return policy, m.encoding.get_encoder()


def rank_generator(seed):
    # One stream per rank, as set_mpi_seed; on the device, where sampling happens.
    return torch.Generator(device=utils.get_device()).manual_seed(seed + 100003 * ranks.get_rank())


def make_labels(exp, hparams: train_reward_module.HParams, path, *, num_labels, seed):
    """Write num_labels best_of_N records to path, labelled by the experiment's labeler; collective. Each
    rank (in its section) labels its share of its own queries with its own random streams."""
    task = hparams.task
    label_type = label_types.get(hparams.labels.type)
    if not isinstance(label_type, label_types.PickBest):
        raise ValueError(f"the {exp.name} labels are best_of_N; labels.type is '{hparams.labels.type}'")
    policy, encoder = frozen_policy(task.policy.initial_model, task)
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)
    per_rank = utils.ceil_div(num_labels, ranks.get_world_size())
    batch_size = min(utils.exact_div(hparams.rollout_batch_size, ranks.get_world_size()), per_rank)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=batch_size)
    # run.microbatch_size 'auto': planned as train_reward plans it (its normalization samples such rollouts).
    execution = Execution.prepare(hparams.run, memory.reward_passes(hparams), policy.model_hparams,
                                  resident=1, trained=0, what=f'{exp.name} labels')
    printing, progress = ranks.is_root(), Progress(utils.ceil_div(per_rank, batch_size) * len(ranks.local_ranks()))

    def rank_records():
        generator = rank_generator(seed)
        rng = np.random.RandomState(seed + 100003 * ranks.get_rank())
        records = []
        while len(records) < per_rank:
            queries = sampler()['tokens']
            with torch.no_grad():
                # The labelers saw postprocessed (truncated) samples, as the original's label files hold; a
                # program rates any, so no truncation filter (at the miniature's pass rate, 20 %, it would
                # cost 5 times the samples).
                samples, _ = sample_responses(policy, queries, label_type.num_responses, length=task.response_length,
                                              generator=generator, postprocess=postprocess, execution=execution)
            best = label_best(exp.labeler, samples, encoder, rng)
            for i in range(len(queries)):
                record = dict(query=queries[i].tolist(), best=int(best[i]))
                record.update({f'sample{j}': samples[i, j].tolist() for j in range(label_type.num_responses)})
                records.append(record)
            progress.done += 1
            if printing and progress.due():
                print(f'[{exp.name} labels: batch {progress()}]', flush=True)
        return records[:per_rank]

    every_rank = distributed.gather_ranks_to_root(ranks.for_each_rank(rank_records))
    if ranks.is_root():
        records = [record for rank in every_rank for record in rank][:num_labels]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, json.dumps(records).encode())
    utils.mpi_bcast(None)  # everyone waits until the file is in place


def labels_key(exp, hparams: train_reward_module.HParams, *, num_labels, seed):
    """What make_labels' records depend on, JSON-able: the labeler, the initial model (its checkpoint's sha256),
    the queries (their stream's fingerprint), the task's other settings, the label type, the sampling batch,
    bf16, the ranks (each samples its share from its own streams), the seed and the number. Collective (the
    query data may be prepared)."""
    task = hparams.task
    model = trained_models.TrainedModel(task.policy.initial_model)
    checkpoint = model.checkpoint()
    queries = lm_tasks.make_query_sampler(hparams=task, encoder=model.encoding.get_encoder(), batch_size=1)
    settings = task.to_nested_dict()
    settings['policy'].pop('initial_model')
    return dict(experiment=exp.name, labeler=exp.labeler.name,
                initial_model=files.sha256_file(checkpoint) if checkpoint else model.name,
                queries=queries.fingerprint, task=settings, label_type=hparams.labels.type,
                rollout_batch_size=hparams.rollout_batch_size, bf16=hparams.run.use_bf16(),
                sampler=(f'chunked, {vocab_sampling.products_precision()} precision'
                         if vocab_sampling.chunked_on(utils.get_device()) else 'plain'),
                ranks=ranks.get_world_size(), seed=seed, num_labels=num_labels)


def cache_path(exp, key):
    """Where the labels of labels_key `key` are kept: datasets_dir()/<experiment>_labels/<its hash>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(gcs.datasets_dir(), f'{exp.name}_labels', f'{digest}.json')


def labeler_ceiling(labeler, records, encoder):
    """The expected accuracy of a perfect learner of the labeler on best_of_N records: it can only pick
    one of the samples tied for the highest score, and the label is a random one of those."""
    sample_keys = sorted(k for k in records[0] if k.startswith('sample'))
    inverse_ties = []
    for record in records:
        scores = np.array([labeler.score(encoder.decode(record[k])) for k in sample_keys])
        inverse_ties.append(1 / np.sum(scores == scores.max()))
    return float(np.mean(inverse_ties))


def bag_of_words_accuracy(train, held_out, *, padding_token, l2=3e-4, max_iter=300):
    """A baseline for the reward model: the held-out accuracy of a bag-of-words model trained on the same
    best_of_N records (train, held_out: lists of records). A weight per token; a response's score is the sum of
    its tokens' weights (the padding token's none), fitted by the label type's loss (softmax cross-entropy over
    the N responses) plus l2 * |w|^2, by L-BFGS from 0. The responses only, as the labeler reads them; a k-way
    tie for the highest score counts 1/k, as train_reward's accuracy (best_credit)."""
    sample_keys = sorted(k for k in train[0] if k.startswith('sample'))

    def tensors(records):
        samples = torch.tensor([[r[k] for k in sample_keys] for r in records])  # [n, N, length]
        return samples, samples != padding_token, torch.tensor([r['best'] for r in records])
    (samples, real, best), (test_samples, test_real, test_best) = tensors(train), tensors(held_out)
    weights = torch.zeros(max(int(samples.max()), int(test_samples.max()), padding_token) + 1, requires_grad=True)

    def scores(samples, real):
        return (weights[samples] * real).sum(dim=-1)  # [n, N]
    optimizer = torch.optim.LBFGS([weights], max_iter=max_iter, line_search_fn='strong_wolfe')

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(scores(samples, real), best) + l2 * weights.square().sum()
        loss.backward()
        return loss
    optimizer.step(closure)
    with torch.no_grad():
        return float(reward_evaluation.best_credit(scores(test_samples, test_real), test_best).mean())
