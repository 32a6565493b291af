"""Offline experiments: the paper's whole pipeline on a CPU in minutes, nothing downloaded (no original).

An OfflineExperiment (below) names a small GPT-2 to pretrain, a corpus to pretrain it on, and a program
that plays the human labelers. `python launch.py train_policy <its name> NAME` then runs:

1. Initial model (`task.policy.initial_model = <name>`): the small GPT-2 of `pretrain` on the experiment's
   encoding, pretrained on its corpus (next-token prediction) and cached in saved_models_dir()/<name>,
   reused while the pretraining hparams, the encoding and the corpus are unchanged.
2. Labels (`labels.source = <name>`): for each query of the task's dataset the initial policy samples 4
   responses at the task temperature, and the labeler's score of each (postprocessed) response picks the
   best: the highest score, ties broken at random (seeded). The labels are written in the original's
   best_of_4 JSON format ({query, sample0..3, best}, token ids) to <save_dir>/<name>_labels.json, with
   held-out records after the first labels.num_train, and train_reward reads them back through its
   normal download_labels path (validation included).
3. The normal train_reward (normalization before and after) and train_policy (PPO, adaptive KL).
4. A report, printed and written to <save_dir>/<name>_report.json, with every curve in
   <save_dir>/<name>_curves.png: the labeler's score of samples on the test queries from the initial and
   the trained policy (mean +- std), objective/kl against the adaptive target, the reward model's
   held-out accuracy against chance and against the best a perfect learner of the labeler can do (ties
   are broken at random, so 100% can be out of reach), samples, the wall time and the time per phase.

`python launch.py train_reward <its name> NAME` runs steps 1-3 for the reward model only and reports its
accuracy. The experiments' sizes, learning rates and KL targets are in launch.py. The demo's experiment
is in demo/__init__.py; an experiment package registers its query dataset and gives launch.py its two
entry points, so that nothing else in the library knows its name.

Every step is collective under --mpi N: each rank samples its share (in its section, utils/ranks.py) and
the process that carries rank 0 writes the files.
"""

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from lm_human_preferences import label_types, lm_tasks, rewards, train_policy as train_policy_module, \
    train_reward as train_reward_module
from lm_human_preferences.language import checkpoints, encodings, model, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files
from lm_human_preferences.training import plots
from lm_human_preferences.training.adam import AdamTF
from lm_human_preferences.training.execution import Execution
from lm_human_preferences.training.run import Progress

# Samples per policy shown in the report.
REPORT_EXAMPLES = 5


@dataclass(frozen=True)
class PretrainHParams:
    """An experiment's initial model and its pretraining on its corpus (next-token prediction)."""
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_ctx: int = 64  # >= query_length + response_length of the task; the pretraining windows' length
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3  # decayed linearly to 0
    seed: int = 0
    # The products with the output embedding in bf16 where the CPU multiplies bf16 natively (see
    # pretraining_products_dtype): for a large vocabulary, where they are most of a step's time.
    bf16_products: bool = False


@dataclass(frozen=True)
class Labeler:
    """A program in the human labelers' seat: score(text) of each response; the best of N is a highest
    score. `name` prefixes the report's keys ('<name>_initial_mean', ...); `description` is the line the
    report prints; `score_name` names the score in the report and its figure; `title` names the labeler in
    a sentence ('a perfect learner of <title>')."""
    name: str
    description: str
    score_name: str
    score: Callable[[str], float]
    title: str

    def scores(self, responses, encoder):
        """Scores [b] (float64: a score's ties stay exact) of response token ids [b, n], decoded (the
        padding token decodes to '')."""
        return torch.tensor([float(self.score(encoder.decode(r))) for r in responses.tolist()], dtype=torch.float64)


@dataclass(frozen=True)
class OfflineExperiment:
    """name: the initial model (saved_models_dir()/<name>), the labels.source that asks for generated
    labels, and the prefix of the files it writes in the save dir. corpus(): the pretraining text.
    held_out_labels: label records made after labels.num_train, on which train_reward evaluates.
    eval_queries: test queries sampled (once per policy) for the report. cpu_threads: torch's intra-op
    threads while it runs on a CPU."""
    name: str
    encoding: encodings.Encoding
    corpus: Callable[[], str]
    pretrain: PretrainHParams
    labeler: Labeler
    held_out_labels: int = 256
    eval_queries: int = 256
    cpu_threads: int = 1

    def __post_init__(self):
        # task.policy.initial_model <name> names the model this experiment makes (its context length known at
        # launch, for the length checks).
        trained_models.OFFLINE_MODELS[self.name] = self.pretrain.n_ctx


def model_dir(exp: OfflineExperiment):
    return trained_models.offline_model_dir(exp.name)


# ---------------------------------------------------------------------------------------------------
# 1. The initial model

def _pretrain_key(exp: OfflineExperiment):
    """What the cached model was made from: a different key means it must be made again."""
    return dict(pretrain=asdict(exp.pretrain), encoding=exp.encoding.name,
                corpus_sha1=hashlib.sha1(exp.corpus().encode()).hexdigest(),
                products_dtype=str(pretraining_products_dtype(exp.pretrain)).removeprefix('torch.'))


def pretraining_products_dtype(hparams: PretrainHParams):
    """The dtype of the pretraining's three products with the output embedding (_LinearCrossEntropy):
    with hparams.bf16_products, bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: 2.5x
    fp32's speed on this project's CPU), else fp32 (bf16 would be emulated, slower than fp32). The
    pretraining is ours, not the original's: its precision is our choice."""
    native = any(getattr(torch.cpu, name, lambda: False)()
                 for name in ('_is_avx512_bf16_supported', '_is_amx_tile_supported'))
    return torch.bfloat16 if hparams.bf16_products and native else torch.float32


class _LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits h @ w.T [n, n_vocab] against targets [n], computed a chunk of
    rows at a time with its gradients (softmax - one-hot, then the two products) in the forward pass: with
    GPT-2's 50,257-token vocabulary the logits' softmax and its backward otherwise cost as much as the
    projection itself, and the whole [n, n_vocab] logits never exist at once. Same value and gradients as
    F.cross_entropy(F.linear(h, w), targets) (to float rounding) when products_dtype is h's dtype.

    products_dtype: the dtype of the three products (the logits, and the gradients' two); the softmax, the
    loss and the accumulated gradients stay in h's dtype. bf16 products are mixed-precision training as on
    a GPU: the loss is within about 1e-5 and the gradients within about 1% of fp32's."""

    CHUNK = 128  # rows: 25 MB of fp32 logits with GPT-2's vocabulary

    @staticmethod
    def forward(ctx, h, w, targets, products_dtype):
        n = h.shape[0]
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
        total = h.new_zeros(())
        w_products = w.to(products_dtype)  # a no-op in h's dtype
        for start in range(0, n, _LinearCrossEntropy.CHUNK):
            rows = slice(start, start + _LinearCrossEntropy.CHUNK)
            h_rows, t_rows = h[rows].to(products_dtype), targets[rows]
            logits = (h_rows @ w_products.T).to(h.dtype)  # [c, n_vocab]
            target_logits = logits.gather(1, t_rows[:, None])[:, 0]
            # log-softmax with one exp pass: logsumexp = max + log(sum(exp(logits - max))).
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: the logits are not needed again
            sums = probs.sum(dim=1, keepdim=True)
            total += (top[:, 0] + sums[:, 0].log() - target_logits).sum()
            probs.div_(sums)
            probs[torch.arange(len(t_rows)), t_rows] -= 1  # d loss / d logits, for the sum over rows
            probs = probs.to(products_dtype)
            grad_h[rows] = probs @ w_products
            if probs.dtype == grad_w.dtype:
                grad_w.addmm_(probs.T, h_rows)  # fused: no [n_vocab, e] temporary
            else:
                grad_w += probs.T @ h_rows  # a bf16 product, summed into the fp32 gradient
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.n
        return grad_h * scale, grad_w * scale, None, None


def pretrain(exp: OfflineExperiment, out_dir, key):
    """Train the experiment's initial model on its corpus and save it to out_dir (our checkpoint format),
    with key (_pretrain_key: what it was made from) in pretrain.json.

    Written to a temporary dir that is then renamed into place, so a crash never leaves a half model.
    """
    hparams = exp.pretrain
    tokens = torch.tensor(exp.encoding.get_encoder().encode(exp.corpus()), dtype=torch.long)
    model_hparams = model.HParams(n_vocab=exp.encoding.n_vocab, n_ctx=hparams.n_ctx, n_embd=hparams.n_embd,
                                  n_head=hparams.n_head, n_layer=hparams.n_layer)
    # fork_rng: the model's initialisation uses the global RNG; the caller's stream stays untouched.
    with torch.random.fork_rng():
        torch.manual_seed(hparams.seed)
        lm = model.Model(model_hparams)
    generator = torch.Generator().manual_seed(hparams.seed)
    optimizer = AdamTF(lm.parameters(), lr=hparams.lr)
    offsets = torch.arange(hparams.n_ctx + 1)
    products_dtype = pretraining_products_dtype(hparams)
    progress = Progress(hparams.steps)
    for step in range(hparams.steps):
        starts = torch.randint(0, len(tokens) - hparams.n_ctx - 1, (hparams.batch_size, 1), generator=generator)
        window = tokens[starts + offsets]  # [batch, n_ctx + 1]
        h = lm(window[:, :-1], lm_logits=False, return_present=False)['h']  # [batch, n_ctx, n_embd]
        loss = _LinearCrossEntropy.apply(h.reshape(-1, hparams.n_embd), lm.wte, window[:, 1:].reshape(-1),
                                         products_dtype)
        for group in optimizer.param_groups:
            group['lr'] = hparams.lr * (1 - step / hparams.steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress.done = step + 1
        if progress.due():
            print(f'[{exp.name} pretraining: step {progress()}, loss {loss.item():.3f}]', flush=True)

    tmp = f'{out_dir}.tmp-{os.getpid()}'
    checkpoints.save_checkpoint(tmp, hparams.steps, lm, hparams=model_hparams, encoding=exp.encoding)
    with open(os.path.join(tmp, 'pretrain.json'), 'w') as f:
        json.dump(key, f, indent=2)
    if os.path.isdir(out_dir):  # a stale model (other hparams or corpus): replaced
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def ensure_pretrained(exp: OfflineExperiment):
    """Make saved_models_dir()/<name> unless it holds a model made from the experiment's pretraining
    hparams, encoding and corpus; collective (rank 0 trains, the others wait). Returns the dir."""
    out_dir = model_dir(exp)
    if not utils.is_root():
        error = utils.mpi_bcast(None)
        if error is not None:
            raise RuntimeError(f'{exp.name} pretraining failed on rank 0: {error}')
        return out_dir
    key_path = os.path.join(out_dir, 'pretrain.json')
    cached = None
    if os.path.isfile(key_path):
        with open(key_path) as f:
            cached = json.load(f)
    try:
        key = _pretrain_key(exp)
        if cached == key and checkpoints.latest_checkpoint(out_dir) is not None:
            print(f'{exp.name}: using the pretrained initial model in {out_dir}')
        else:
            p = exp.pretrain
            print(f'{exp.name}: pretraining the initial model into {out_dir} ({p.n_layer} layers, width '
                  f'{p.n_embd}, {exp.encoding.n_vocab:,}-token vocabulary, {p.steps} steps of {p.batch_size} '
                  f'x {p.n_ctx} tokens; {key["products_dtype"]} products with the output embedding)', flush=True)
            pretrain(exp, out_dir, key)
    except Exception as e:
        utils.mpi_bcast(f'{type(e).__name__}: {e}')  # the other ranks must not wait for a model that never comes
        raise
    utils.mpi_bcast(None)
    return out_dir


# ---------------------------------------------------------------------------------------------------
# 2. Labels

def pick_best(scores, rng):
    """Index of the highest score in each row of scores [n, N], ties broken at random by rng."""
    return np.array([rng.choice(np.flatnonzero(row == row.max())) for row in np.asarray(scores)])


def _frozen_policy(model_name, task):
    """A frozen Policy of the named model (a name or dir, as task.policy.initial_model) for the task."""
    m = trained_models.TrainedModel(model_name)
    policy = Policy.for_task(m, task).to(utils.get_device())
    policy.requires_grad_(False)
    return policy, m.encoding.get_encoder()


def _generator(seed):
    # One stream per rank, as set_mpi_seed; on the device, where sampling happens.
    return torch.Generator(device=utils.get_device()).manual_seed(seed + 100003 * utils.get_rank())


def make_labels(exp: OfflineExperiment, hparams: train_reward_module.HParams, path, *, num_labels, seed):
    """Write num_labels best_of_N records to path, labelled by the experiment's labeler; collective. Each
    rank (in its section) labels its share of its own queries with its own random streams."""
    task = hparams.task
    label_type = label_types.get(hparams.labels.type)
    if not isinstance(label_type, label_types.PickBest):
        raise ValueError(f"the {exp.name} labels are best_of_N; labels.type is '{hparams.labels.type}'")
    policy, encoder = _frozen_policy(task.policy.initial_model, task)
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)
    per_rank = utils.ceil_div(num_labels, utils.get_world_size())
    batch_size = min(utils.exact_div(hparams.rollout_batch_size, utils.get_world_size()), per_rank)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=batch_size)
    # run.microbatch_size 'auto': planned as train_reward plans it (its normalization samples such rollouts).
    execution = Execution.prepare(hparams.run, train_reward_module.memory_passes(hparams), policy.model_hparams,
                                  resident=1, trained=0, what=f'{exp.name} labels')
    printing, progress = utils.is_root(), Progress(utils.ceil_div(per_rank, batch_size) * len(utils.local_ranks()))

    def rank_records():
        generator = _generator(seed)
        rng = np.random.RandomState(seed + 100003 * utils.get_rank())
        records = []
        while len(records) < per_rank:
            queries = sampler()['tokens']
            with torch.no_grad():
                # The labelers saw postprocessed (truncated) samples, as the original's label files hold.
                samples = [postprocess(policy.respond(queries, task.response_length, generator=generator,
                                                      execution=execution)['responses'])
                           for _ in range(label_type.num_responses)]
            scores = torch.stack([exp.labeler.scores(s, encoder) for s in samples], dim=1).numpy()  # [b, N]
            best = pick_best(scores, rng)
            for i in range(len(queries)):
                record = dict(query=queries[i].tolist(), best=int(best[i]))
                record.update({f'sample{j}': s[i].tolist() for j, s in enumerate(samples)})
                records.append(record)
            progress.done += 1
            if printing and progress.due():
                print(f'[{exp.name} labels: batch {progress()}]', flush=True)
        return records[:per_rank]

    every_rank = utils.gather_ranks_to_root(utils.for_each_rank(rank_records))
    if utils.is_root():
        records = [record for rank in every_rank for record in rank][:num_labels]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, json.dumps(records).encode())
    utils.mpi_bcast(None)  # everyone waits until the file is in place


def labeler_ceiling(labeler: Labeler, records, encoder):
    """The expected accuracy of a perfect learner of the labeler on best_of_N records: it can only pick
    one of the samples tied for the highest score, and the label is a random one of those."""
    sample_keys = sorted(k for k in records[0] if k.startswith('sample'))
    inverse_ties = []
    for record in records:
        scores = np.array([labeler.score(encoder.decode(record[k])) for k in sample_keys])
        inverse_ties.append(1 / np.sum(scores == scores.max()))
    return float(np.mean(inverse_ties))


def resolve_initial_model(exp: OfflineExperiment, *tasks):
    """task.policy.initial_model <name> names the experiment's pretrained model, made once
    (ensure_pretrained): the trainers get its directory. All the tasks of a run at once, so that it is
    checked (and reported) once. Collective."""
    named = [task for task in tasks if task.policy.initial_model == exp.name]
    if named:
        model = ensure_pretrained(exp)
        for task in named:
            task.policy.initial_model = model


def prepare_reward_training(exp: OfflineExperiment, hparams: train_reward_module.HParams, save_dir):
    """For labels.source <name>, make the labels (<save_dir>/<name>_labels.json; a resumed run reuses
    them) and point labels.source at them. Collective. Returns the held-out accuracy a perfect learner of
    the labeler would reach (rank 0; None when the labels are not ours)."""
    if hparams.labels.source != exp.name:
        return None
    if not save_dir:
        raise ValueError(f"labels.source '{exp.name}' writes the labels into run.save_dir, which is not set")
    path = os.path.join(save_dir, f'{exp.name}_labels.json')
    num_labels = hparams.labels.num_train + exp.held_out_labels
    started = time.time()
    if not utils.mpi_bcast(os.path.isfile(path)):
        make_labels(exp, hparams, path, num_labels=num_labels, seed=hparams.run.seed or 0)
        made = f'made in {time.time() - started:.0f}s'
    else:
        made = 'reused: this save dir already had them'
    hparams.labels.source = path
    error = ceiling = None
    if utils.is_root():
        with open(path) as f:
            records = json.load(f)
        if len(records) != num_labels:
            error = (f'{path} holds {len(records)} label records, this run needs {num_labels} (labels.num_train '
                     f'{hparams.labels.num_train} + {exp.held_out_labels} held out): it belongs to another run; '
                     f'choose another --save_dir')
        else:
            print(f"{exp.name}: {num_labels} labels by {exp.labeler.description} in {path} "
                  f"({hparams.labels.num_train} to train on, {exp.held_out_labels} held out; {made})")
            if exp.held_out_labels:
                encoder = trained_models.TrainedModel(hparams.task.policy.initial_model).encoding.get_encoder()
                ceiling = labeler_ceiling(exp.labeler, records[hparams.labels.num_train:], encoder)
    error = utils.mpi_bcast(error)  # every rank stops, not only rank 0
    if error is not None:
        raise ValueError(error)
    return ceiling


# ---------------------------------------------------------------------------------------------------
# 4. The report

@torch.no_grad()
def sample_scores(exp: OfflineExperiment, model_name, task, *, seed):
    """The labeler's scores of one response per test query, for exp.eval_queries test queries (the same
    queries for every model); collective. Returns (scores [n] on every process, rank 0's first samples
    as (query, response) text pairs)."""
    policy, encoder = _frozen_policy(model_name, task)
    per_rank = utils.exact_div(exp.eval_queries, utils.get_world_size())
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=per_rank, mode='test')
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)

    def rank_scores():
        queries = sampler()['tokens']
        responses = postprocess(policy.respond(queries, task.response_length, generator=_generator(seed))['responses'])
        examples = [(encoder.decode(q), encoder.decode(r))
                    for q, r in zip(queries[:REPORT_EXAMPLES].tolist(), responses[:REPORT_EXAMPLES].tolist())]
        return exp.labeler.scores(responses, encoder).tolist(), examples

    results = utils.for_each_rank(rank_scores)
    scores = torch.tensor([s for rank in utils.all_gather_ranks([r for r, _ in results]) for s in rank])
    return scores, results[0][1]


@torch.no_grad()
def best_of_n(exp: OfflineExperiment, hparams: train_policy_module.HParams, *, n, queries, seed):
    """Ours, a diagnostic of how much of the labeler a run's reward model holds and how much of it PPO's
    score keeps: n samples of the initial policy for each of `queries` test queries. For k = 1, 2, 4, ... n:
    the labeler's mean score of the sample ranked first among the first k by the reward model (on the
    postprocessed sample), by PPO's score (the same, with penalty_reward_value for the samples the task's
    filter rejects) and by the labeler itself, beside best-of-k's KL from the initial policy, at most
    log k - (k - 1) / k nats (Stiennon et al. 2020; Beirami et al. 2024), against PPO's objective/kl. One process.
    Returns (rows, the labeler's scores [queries, n])."""
    with _cpu_threads(exp):
        return _best_of_n(exp, hparams, n=n, queries=queries, seed=seed)


def _best_of_n(exp, hparams, *, n, queries, seed):
    task = hparams.task
    policy, encoder = _frozen_policy(task.policy.initial_model, task)
    reward_model = rewards.TrainedRewardModel(hparams.rewards.trained_model, exp.encoding).to(utils.get_device())
    score_fn = train_policy_module.make_score_fn(task, reward_model)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=queries, mode='test')
    query_tokens = sampler()['tokens']
    generator = _generator(seed)
    rankings = dict(reward_model=[], ppo_score=[])
    labeler_scores = []
    for _ in range(n):
        responses = policy.respond(query_tokens, task.response_length, generator=generator)['responses']
        ppo_scores, postprocessed, _ = score_fn(query_tokens, responses)
        rankings['reward_model'].append(reward_model.score_fn(query_tokens, postprocessed).float().cpu())
        rankings['ppo_score'].append(ppo_scores.float().cpu())
        labeler_scores.append(exp.labeler.scores(postprocessed, encoder))
    labeler_scores = torch.stack(labeler_scores, dim=1)  # [q, n]
    rankings = {name: torch.stack(columns, dim=1) for name, columns in rankings.items()}  # [q, n] each
    rows, k = [], 1
    while k <= n:
        row = dict(k=k, kl_bound=float(np.log(k) - (k - 1) / k))
        for name, ranking in rankings.items():
            picked = labeler_scores.gather(1, ranking[:, :k].argmax(dim=1, keepdim=True))
            row[f'{name}_pick'] = float(picked.mean())
        row['labeler_pick'] = float(labeler_scores[:, :k].max(dim=1).values.mean())
        rows.append(row)
        k *= 2
    return rows, labeler_scores


def read_stats(path):
    """The rows of a stats JSONL file (utils.core.record_stats), [] when it does not exist."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def score_report(labeler: Labeler, before, after):
    """The labeler's scores [n] of the initial and the trained policy's samples: mean and std of each, and
    the gain in standard deviations of the initial policy's scores (the unit of the experiments' bars) with
    its standard error (the two samples independent: one response per query from each policy)."""
    def mean_std(when, scores):
        return {f'{labeler.name}_{when}_mean': float(scores.mean()),
                f'{labeler.name}_{when}_std': float(scores.std(unbiased=False))}
    unit = float(before.std(unbiased=False)) or float('nan')  # no unit when the initial scores are all equal
    gain = float(after.mean() - before.mean()) / unit
    gain_se = float((before.var() / len(before) + after.var() / len(after)).sqrt()) / unit
    return dict(eval_queries=len(before), **mean_std('initial', before), **mean_std('trained', after),
                **{f'{labeler.name}_gain_initial_stds': gain, f'{labeler.name}_gain_initial_stds_se': gain_se})


def reward_report(save_dir, *, ceiling, num_responses):
    """The reward model part of the report, from <save_dir>/train_reward_stats.jsonl ({} before any eval):
    its accuracy on the held-out labels, on its training labels (eval_train_labels) when measured."""
    rows = read_stats(os.path.join(save_dir, 'train_reward_stats.jsonl'))
    evals = [r for r in rows if 'eval/accuracy' in r]
    if not evals:
        return {}
    train_evals = [r for r in rows if 'eval_train/accuracy' in r]
    return dict(rm_heldout_accuracy=evals[-1]['eval/accuracy'], rm_chance_accuracy=1 / num_responses,
                rm_ceiling_accuracy=ceiling,
                rm_train_accuracy=train_evals[-1]['eval_train/accuracy'] if train_evals else None)


def policy_report(save_dir, hparams):
    """objective/kl at the end of training (mean over the last 10% of PPO batches) against the target
    ({} before any PPO batch)."""
    rows = read_stats(os.path.join(save_dir, 'train_policy_stats.jsonl'))
    if not rows:
        return {}
    tail = rows[-max(1, len(rows) // 10):]
    adaptive = hparams.rewards.adaptive_kl
    return dict(
        kl=float(np.mean([r['objective/kl'] for r in tail])),
        kl_target=adaptive.target if adaptive is not None else None,
        kl_coef_start=rows[0]['objective/kl_coef'], kl_coef_end=rows[-1]['objective/kl_coef'],
        score_start=rows[0]['objective/score'], score_end=float(np.mean([r['objective/score'] for r in tail])),
        ppo_batches=len(rows))


def format_report(exp: OfflineExperiment, report):
    labeler = exp.labeler
    lines = ['=' * 78, f'{exp.name.upper()} REPORT', '=' * 78, f'labeler: {labeler.description}']
    key = labeler.name
    if f'{key}_initial_mean' in report:
        lines.append(f"{labeler.score_name} of {report['eval_queries']} samples on test queries: "
                     f"{report[f'{key}_initial_mean']:.2f} +- {report[f'{key}_initial_std']:.2f} (initial policy) -> "
                     f"{report[f'{key}_trained_mean']:.2f} +- {report[f'{key}_trained_std']:.2f} (trained policy)")
        lines.append(f"  gain: {report[f'{key}_gain_initial_stds']:+.2f} standard deviations of the initial policy's "
                     f"scores (standard error {report[f'{key}_gain_initial_stds_se']:.2f})")
    if 'kl' in report:
        target = f"{report['kl_target']:g}" if report['kl_target'] is not None else 'none (fixed kl_coef)'
        lines.append(f"objective/kl (last 10% of {report['ppo_batches']} PPO batches): {report['kl']:.2f} nats, "
                     f"adaptive target {target}; kl_coef {report['kl_coef_start']:.3f} -> {report['kl_coef_end']:.3f}")
        lines.append(f"objective/score (reward model): {report['score_start']:+.2f} -> {report['score_end']:+.2f}")
    if 'rm_heldout_accuracy' in report:
        ceiling = report.get('rm_ceiling_accuracy')
        ceiling = f', a perfect learner of {labeler.title}: {100 * ceiling:.1f}%' if ceiling else ''
        train = report.get('rm_train_accuracy')
        train = f'; on its training labels: {100 * train:.1f}%' if train is not None else ''
        lines.append(f"reward model held-out accuracy: {100 * report['rm_heldout_accuracy']:.1f}% "
                     f"(chance {100 * report['rm_chance_accuracy']:.0f}%{ceiling}){train}")
    for name, examples in report.get('examples', {}).items():
        lines.append(f'samples of the {name} policy (query | response):')
        lines.extend(f'  {q} | {r}' for q, r in examples)
    phases = ', '.join(f'{phase} {seconds:.0f}s' for phase, seconds in report.get('phase_times_s', {}).items())
    lines.append(f"wall time: {report['wall_time_s']:.0f}s" + (f' ({phases})' if phases else ''))
    lines.append('=' * 78)
    return '\n'.join(lines)


@contextlib.contextmanager
def _cpu_threads(exp: OfflineExperiment):
    """exp.cpu_threads intra-op threads while the experiment runs on a CPU (restored after)."""
    if utils.get_device().type != 'cpu':
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(exp.cpu_threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def score_panel(exp: OfflineExperiment, report):
    """A learning-curve panel (training/plots.py) of the labeler's score of samples before and after PPO."""
    key = exp.labeler.name
    def draw(ax):
        stats = [(report[f'{key}_{when}_mean'], report[f'{key}_{when}_std']) for when in ('initial', 'trained')]
        names = [f'{name}\n{mean:.2f} ± {std:.2f}' for name, (mean, std) in zip(('initial policy', 'trained policy'), stats)]
        ax.bar(names, [mean for mean, _ in stats], yerr=[std for _, std in stats], capsize=6, color=['C7', 'C0'])
        ax.set_ylabel(f'{exp.labeler.score_name} (mean ± std)')
    return draw, f"{exp.labeler.score_name} of {report['eval_queries']} samples\non test queries"  # two lines: one is too wide


def report_file(exp: OfflineExperiment, save_dir):
    return os.path.join(save_dir, f'{exp.name}_report.json')


def plot_report(exp: OfflineExperiment, save_dir, out=None, *, title=None):
    """The experiment's figure of a save dir holding its report: every learning curve, the labeler's score
    of samples before and after PPO, and on the reward model's accuracy the best a perfect learner of the
    labeler can reach; at out (default <save_dir>/<name>_curves.png, which the README shows from static/).
    `python sample.py plot` draws it again. Returns its path, or None when save_dir holds no report."""
    path = report_file(exp, save_dir)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        report = json.load(f)
    extra = [score_panel(exp, report)] if f'{exp.labeler.name}_initial_mean' in report else []
    ceiling = report.get('rm_ceiling_accuracy')
    references = dict(accuracy=[(ceiling, f'a perfect learner of {exp.labeler.title} {100 * ceiling:.1f}%',
                                 'C1', ':')]) if ceiling else None
    command = 'train_policy' if 'kl' in report else 'train_reward'
    return plots.plot_combined(
        save_dir, out or os.path.join(save_dir, f'{exp.name}_curves.png'), extra_panels=extra, references=references,
        title=title or f'python launch.py {command} {exp.name} {os.path.basename(os.path.normpath(save_dir))}')


def _finish(exp: OfflineExperiment, report, save_dir):
    """Print the report and, in the save dir, write it (<save_dir>/<name>_report.json) and its figure
    (plot_report)."""
    if utils.is_root():
        print(format_report(exp, report))
        if save_dir:
            files.atomic_write(report_file(exp, save_dir), json.dumps(report, indent=2).encode())
            print(f'{exp.name}: all curves in {plot_report(exp, save_dir)}')
    return report


class _Phases:
    """Wall time per phase of a command, in order: `with phases('labels'): ...`."""

    def __init__(self):
        self.started = time.time()
        self.spans = {}  # name -> (start, end)

    @contextlib.contextmanager
    def __call__(self, name):
        start = time.time()
        try:
            yield
        finally:
            self.spans[name] = (start, time.time())

    def split(self, name, first, second, *, at):
        """Divide phase `name` at time `at` (clamped into it; None: at its start) into `first`, `second`."""
        start, end = self.spans.pop(name)
        at = min(max(start if at is None else at, start), end)
        self.spans[first], self.spans[second] = (start, at), (at, end)

    def seconds(self):
        return {name: end - start for name, (start, end) in self.spans.items()}


# ---------------------------------------------------------------------------------------------------
# The commands (an experiment package's train_policy / train_reward call these)

def train_reward(exp: OfflineExperiment, hparams: train_reward_module.HParams):
    """`launch.py train_reward <name>`: prepare, train_reward.train, report the held-out accuracy."""
    with _cpu_threads(exp):
        return _train_reward(exp, hparams)


def train_policy(exp: OfflineExperiment, hparams: train_policy_module.HParams):
    """`launch.py train_policy <name>`: prepare, train_policy.train (reward model first), report."""
    with _cpu_threads(exp):
        return _train_policy(exp, hparams)


def _check_labeler(exp: OfflineExperiment):
    # Fails now, in one line, when the labeler cannot run (a package not installed), not after pretraining.
    exp.labeler.score('')


def _train_reward(exp, hparams):
    phases = _Phases()
    save_dir = hparams.run.save_dir
    _check_labeler(exp)
    with phases('initial model'):
        resolve_initial_model(exp, hparams.task)
    with phases('labels'):
        ceiling = prepare_reward_training(exp, hparams, save_dir)
    with phases('train_reward'):
        train_reward_module.train(hparams)
    num_responses = label_types.get(hparams.labels.type).num_responses
    report = dict(**reward_report(save_dir, ceiling=ceiling, num_responses=num_responses),
                  phase_times_s=phases.seconds(), wall_time_s=time.time() - phases.started)
    return _finish(exp, report, save_dir)


def _last_write(directory):
    """The newest modification time of the files under directory (None when there are none)."""
    times = [os.path.getmtime(os.path.join(root, f)) for root, _, names in os.walk(directory) for f in names]
    return max(times, default=None)


def _train_policy(exp, hparams):
    phases = _Phases()
    save_dir = hparams.run.save_dir
    if not save_dir:
        raise ValueError(f'the {exp.name} experiment needs run.save_dir: the report compares the saved policy '
                         f'with the initial one')
    _check_labeler(exp)
    reward_hparams = hparams.rewards.train_new_model
    ceiling = None
    with phases('initial model'):
        resolve_initial_model(exp, hparams.task, *([reward_hparams.task] if reward_hparams is not None else []))
    if reward_hparams is not None:
        with phases('labels'):
            ceiling = prepare_reward_training(exp, reward_hparams, save_dir)

    with phases('training'):
        train_policy_module.train(hparams)
    if reward_hparams is not None:
        # train_policy.train trains the reward model first: the reward model's last write ends that phase.
        phases.split('training', 'train_reward', 'train_policy', at=_last_write(os.path.join(save_dir, 'reward_model')))

    seed = hparams.run.seed or 0
    with phases('report samples'):
        before, before_examples = sample_scores(exp, hparams.task.policy.initial_model, hparams.task, seed=seed)
        after, after_examples = sample_scores(exp, os.path.join(save_dir, 'policy'), hparams.task, seed=seed)
    report = dict(labeler=exp.labeler.description, **score_report(exp.labeler, before, after),
                  **policy_report(save_dir, hparams))
    if reward_hparams is not None:
        num_responses = label_types.get(reward_hparams.labels.type).num_responses
        report.update(reward_report(save_dir, ceiling=ceiling, num_responses=num_responses))
    report.update(examples=dict(initial=before_examples, trained=after_examples),
                  phase_times_s=phases.seconds(), wall_time_s=time.time() - phases.started)
    return _finish(exp, report, save_dir)
