#!/usr/bin/env python3
"""Train a reward model on human labels (port of the original train_reward.py; PORTING.md lists what differs)."""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from lm_human_preferences import label_types, lm_tasks, rewards
from lm_human_preferences.language import sample, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.training import (label_files, memory, reward_evaluation, reward_loss, run_checks,
                                          train_state)
from lm_human_preferences.training.adam import AdamTF
from lm_human_preferences.training.execution import RERUN_MAY_CHANGE, Execution, PortRunHParams
from lm_human_preferences.training.progress import Progress
from lm_human_preferences.training.run import Run
from lm_human_preferences.training.side_by_side import RankBlocks, RankGradients
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import finite, hyperparams, ranks


@dataclass
class LabelHParams(hyperparams.HParams):
    type: str = None
    num_train: int = None
    source: str = None
    rules = dict(at_least_1=('num_train',))  # ours, as below: what a field allows, one line at launch (hyperparams)

    def validate(self, *, prefix=''):  # ours
        super().validate(prefix=prefix)
        hyperparams.require_valid(prefix + 'type', label_types.get, self.type)


@dataclass
class RunHParams(PortRunHParams):  # ours: bf16, wandb, microbatch_size, ... (training/execution.py)
    seed: Optional[int] = None  # its range: run_checks.check_seed (the ranks' seeds)
    log_interval: int = 10
    save_interval: int = 50
    save_dir: Optional[str] = None
    rules = dict(at_least_1=('save_interval', 'log_interval'))


@dataclass
class HParams(hyperparams.HParams):
    run: RunHParams = field(default_factory=RunHParams)

    task: lm_tasks.TaskHParams = field(default_factory=lm_tasks.TaskHParams)
    labels: LabelHParams = field(default_factory=LabelHParams)

    batch_size: int = 40  # total across ranks
    lr: float = 5e-5

    rollout_batch_size: int = 64
    normalize_samples: int = 0  # Samples used to estimate reward mean and std
    debug_normalize: int = 0  # Samples used to check that normalization worked
    # Whether, before training, to normalize the rewards on the policy to the scales on the training buffer.
    # (For comparisons, just use mean 0, var 1.)
    normalize_before: bool = False
    # Whether, after training, to normalize the rewards on the ref policy to mean 0, var 1
    # (so the KL coefficient always has the same meaning).
    normalize_after: bool = False
    eval_train_labels: bool = False  # ours: evaluate on the training labels too (held-out ones always)
    rules = dict(at_least_1=('batch_size', 'rollout_batch_size'), at_least_0=('normalize_samples', 'debug_normalize'),
                 positive=('lr',))

    def validate(self, *, prefix=''):
        super().validate(prefix=prefix)
        run_checks.check_reward(self, 1, prefix=prefix)  # across its parts (the original's exact_div), for one rank


def _mean_std(mean, std):
    """'mean +- std' as the original's normalization lines, to 4 significant digits (ours: it printed 17)."""
    return f'{mean:.4g} +- {std:.4g}'


def download_labels(source, label_type, question_schemas, total_labels, *, n_vocab, padding_token):
    """Ours: returns (train, held_out), dicts of name -> CPU tensor [n, *schema.shape]: the first total_labels
    records and those after them, to evaluate on (held_out None when there are none; the original returned the
    first ones only, as lists). The records, each checked ('test': the original's 50 of zeros), are read by
    label_files.read_labels, where the online loop reads them too (it keeps them as records)."""
    schemas = {**question_schemas, **label_type.label_schemas()}
    results = label_files.read_labels(source, schemas, total_labels, n_vocab=n_vocab, padding_token=padding_token)
    return label_files.stack(results[:total_labels], schemas), label_files.stack(results[total_labels:], schemas)


class RewardModelTrainer():
    def __init__(self, *, reward_model, policy, query_sampler, hparams, run, execution=None):
        """policy and query_sampler: None when neither normalization is on. Ours: run, the training/run.Run that logs,
        saves and resumes; execution (training/execution.py; None: as hparams.run says)."""
        self.reward_model = reward_model

        self.policy = policy
        # Counted, so that a resumed run continues each rank's query stream where it was (see save()).
        self.query_sampler = None if query_sampler is None else train_state.CountingSampler(query_sampler)
        self.hparams = hparams
        self.num_ranks = ranks.get_world_size()
        self.execution = execution or Execution.of(hparams.run)
        self.device = self.execution.device
        # Ours: the ranks this process carries, side by side in every batch (rows grouped by rank).
        self.ranks = RankBlocks()

        self.label_type = label_types.get(hparams.labels.type)
        self.question_schemas = self.label_type.question_schemas(
            query_length=hparams.task.query_length,
            response_length=hparams.task.response_length,
        )
        # The responses of a label (each is scored with the label's query).
        self.sample_keys = [k for k in self.question_schemas if k != 'query']

        data_schemas = {
            **self.question_schemas,
            **self.label_type.label_schemas(),
        }
        self.train_buffer = utils.SampleBuffer(capacity=hparams.labels.num_train, schemas=data_schemas)
        self.held_out_labels = None

        self.run = run

        # The original's utils.minimize: the gradients' mean over ranks, then TF1 Adam, epsilon 1e-5, no clipping.
        self.optimizer = AdamTF(self.reward_model.parameters(), lr=hparams.lr, eps=1e-5)
        self.rank_gradients = RankGradients(self.reward_model.parameters())
        # Minibatches trained so far (the original's train_step variable): the only training position.
        self.global_step = 0
        # Ours, for resuming: the label order, the results so far, whether the model checkpoint is written.
        self.train_indices = None
        self.results = {}
        self.done = False

    def _to_device(self, labels):
        # Token ids are stored int32 as the original's buffer; our models take int64 ids.
        return {k: (v.long() if not v.is_floating_point() else v).to(self.device) for k, v in labels.items()}

    def add_to_buffer(self, labels):
        self.train_buffer.add(**labels)

    def train_batch(self, indices, lr):
        """One minibatch: each rank this process carries its own labels (indices: an array per rank), side by side."""
        for group in self.optimizer.param_groups:
            group['lr'] = lr
        self.optimizer.zero_grad(set_to_none=True)
        labels = self._to_device(self.train_buffer.read(np.concatenate(indices)))
        stats = reward_loss.loss(self, labels, train=True, ranks=len(indices))[0]  # the label type's loss, by rank
        self.rank_gradients.mean_into_grads()  # the original's gradient all-reduce (mean over ranks)
        # Ours: stop before a non-finite update is applied (and so before it could be saved).
        finite.check_finite(self.global_step, **finite.per_rank('loss', stats['loss']),
                           grad_norm=finite.grad_norm(self.reward_model.parameters()))
        self.optimizer.step()

        step = self.global_step
        self.global_step += 1
        # The stats averaged over ranks (the original's FlatStats mpi_allreduce_mean), logged in float32 as its.
        stats = {k: torch.tensor(v, dtype=torch.float32) for k, v in self.ranks.mean(stats).items()}
        return self.run.stats.log(stats, step)

    def target_mean_std(self):
        """Returns the means and variances to target for each reward model"""
        # Should be the same on all ranks because the train_buf should be the same
        scales = self.label_type.target_scales(self.train_buffer.data())
        if scales is None:
            return 0.0, 1.0
        # tf.nn.moments: population variance
        mean = scales.float().mean()
        var = ((scales.float() - mean) ** 2).mean()
        return mean.item(), var.sqrt().item()

    @torch.no_grad()
    def stats(self, query_responses):
        """Mean and std of the rewards of every rank's samples, scored rank by rank (ours: RankBlocks.passes)."""
        with self.execution.autocast():
            rewards = [self.ranks.passes(self.reward_model.get_rewards, self.execution.microbatch_size, qs, rs)
                       for qs, rs in query_responses]
        # [ranks, samples per rank], in float64 (ours): E[x^2] - E[x]^2 stays >= 0, the sums do not depend on order
        rewards = torch.cat([self.ranks.view(r) for r in rewards], dim=1).double()
        assert rewards.dim() == 2, f'{tuple(rewards.shape)}'
        sums = torch.stack([rewards.sum(dim=1), rewards.square().sum(dim=1)], dim=1)  # [ranks, 2]
        count = self.num_ranks * rewards.shape[1]
        means, sqr_means = (utils.mpi_allreduce_sum(list(sums.unbind(0))) / count).tolist()
        stds = float(np.sqrt(sqr_means - means ** 2))
        return means, stds

    def log_stats_after_normalize(self, stats):
        if not ranks.is_root():
            return
        means, stds = stats
        print(f'after normalize: {_mean_std(means, stds)} (measured on new samples: debug_normalize '
              f'{self.hparams.debug_normalize})')

    def reset_reward_scales(self):
        self.reward_model.reset_reward_scale()

    def set_reward_norms(self, mean, std, new_mean, new_std):
        if ranks.is_root():
            print(f'targets: {_mean_std(new_mean, new_std)}')
            print(f'before normalize: {_mean_std(mean, std)}')
        # The original asserted np.isfinite; this error names the statistic.
        finite.check_finite(self.global_step, reward_mean=mean, reward_std=std,
                           target_mean=new_mean, target_std=new_std)
        self.reward_model.set_reward_norm(old_mean=mean, old_std=std, new_mean=new_mean, new_std=new_std)

    @torch.no_grad()
    def sample_policy_batch(self):
        """One batch of every rank this process carries, side by side, each from its own queries and streams."""
        length = self.hparams.task.response_length
        queries, uniforms = ranks.concat_ranks(lambda: sample.queries_and_draws(self.query_sampler()['tokens'], length))
        with self.execution.autocast():
            responses = self.policy.respond(queries=queries, length=length, uniforms=uniforms,
                                            execution=self.execution, logprobs=False)['responses']
        return queries, responses

    def sample_policy_responses(self, n_samples):
        """n_samples in total: ceil(n / rollout_batch_size) batches of rollout_batch_size / num_ranks
        queries per rank, as the original, every rank this process carries side by side in each."""
        n_batches = utils.ceil_div(n_samples, self.hparams.rollout_batch_size)
        printing, progress = ranks.is_root(), Progress(n_batches)  # ours: a progress line per batch
        batches = []
        for _ in range(n_batches):
            batches.append(self.sample_policy_batch())
            progress.done += 1
            if printing and progress.due():
                print(f'[normalize sampling {progress()}]', flush=True)
        return batches

    def normalize(self, sample_fn, target_means, target_stds):
        """Ours: returns dict(before=(mean, std), target=..., after=... or None); None without normalize_samples."""
        if not self.hparams.normalize_samples:
            return None

        self.reset_reward_scales()
        query_responses = sample_fn(self.hparams.normalize_samples)
        means, stds = self.stats(query_responses)

        self.set_reward_norms(means, stds, target_means, target_stds)
        result = dict(before=(means, stds), target=(target_means, target_stds), after=None)
        if self.hparams.debug_normalize:
            query_responses = sample_fn(self.hparams.debug_normalize)
            stats = self.stats(query_responses)
            self.log_stats_after_normalize(stats)
            result['after'] = stats
        elif ranks.is_root():  # ours: the original printed this line only with debug_normalize
            print(f'after normalize: {_mean_std(target_means, target_stds)} on those samples, by construction '
                  f'(not measured: debug_normalize N measures it on N new samples)')
        return result

    def train(self):
        """Returns a dict of results (ours): normalize_before, normalize_after, train, eval, eval_train."""
        labels, self.held_out_labels = download_labels(  # ours: the records past labels.num_train are held out
            self.hparams.labels.source,
            label_type=self.label_type,
            question_schemas=self.question_schemas,
            total_labels=self.hparams.labels.num_train,
            n_vocab=self.reward_model.hparams.n_vocab,
            padding_token=self.reward_model.padding_token,
        )
        self.run.record_data(  # ours: a rerun on other labels or queries is refused
            'labels', label_files.label_fingerprint(labels, self.held_out_labels),
            source=label_files.label_source(self.hparams.labels.source))
        if self.query_sampler is not None:
            self.run.record_data('queries', self.query_sampler.sampler.fingerprint)

        self.add_to_buffer(labels)

        # Ours: continue from the save dir's last training state (the labels are checked first).
        if self.resume() and self.done:
            return self.results
        results = self.results

        if self.train_indices is None:  # a fresh run (a resumed one has normalized already)
            if self.hparams.normalize_before:
                target_mean, target_std = self.target_mean_std()
                results['normalize_before'] = self.normalize(self.sample_policy_responses, target_mean, target_std)

            # Make sure each rank gets the same shuffle so we train on each point exactly once (rank 0's)
            permutations = ranks.for_each_rank(lambda: np.random.permutation(self.hparams.labels.num_train))
            self.train_indices = utils.mpi_bcast(permutations[0])
        train_indices = self.train_indices

        # Collect training data for reward model training.  train_indices will include the indices
        # trained on across all ranks, and its size must be a multiple of minibatch_size.
        per_rank_batch_size = utils.exact_div(self.hparams.batch_size, self.num_ranks)

        # Train on train_indices, by global_step (so that a restored global_step resumes the loop)
        if ranks.is_root():
            print("training on", self.hparams.labels.num_train, "in batches of", per_rank_batch_size, "per rank")
        num_batches = utils.exact_div(self.hparams.labels.num_train, self.hparams.batch_size)
        progress = Progress(num_batches, start=self.global_step)  # ours
        while self.global_step < num_batches:
            if self.global_step == num_batches - 1:  # ours: a fallback, should the final state be damaged
                self.save(done=False)
            start_index = self.global_step * self.hparams.batch_size
            end_index = start_index + self.hparams.batch_size
            all_ranks_indices = train_indices[start_index:end_index]
            our_indices = self.ranks.shares(all_ranks_indices)
            lr = (1 - start_index / self.hparams.labels.num_train) * self.hparams.lr
            results['train'] = self.train_batch(our_indices, lr)
            progress.done = self.global_step
            due = progress.due()  # ours: a line every log_interval steps and at least every PRINT_EVERY_S seconds
            if ranks.is_root() and (self.global_step % self.hparams.run.log_interval == 0 or due):
                print(f'[reward_step {progress()}]', flush=True)
            if self.run.save_due(self.global_step):  # ours: every run.save_interval batches, and on a stop signal
                self.save(done=False)

        results.update(reward_evaluation.evaluate_labels(self))  # ours, before normalize_after rescales the model

        if self.hparams.normalize_after:
            target_mean, target_std = 0.0, 1.0
            results['normalize_after'] = self.normalize(self.sample_policy_responses, target_mean, target_std)
        return results

    def save(self, *, done=True):
        """The only place that saves (collective): the training state (ours, training/run.py), and when done (as the
        original, at the end) the model checkpoint in <save_dir>/reward_model."""
        self.run.save(self.global_step, extra=dict(train_indices=self.train_indices, results=self.results),
                      model=done, done=done)
        self.done = done

    def resume(self):
        """Ours: restore the newest valid training state of <save_dir>/reward_model; whether there was one."""
        state = self.run.resume(
            modules=dict(reward_model=self.reward_model), optimizer=self.optimizer,
            samplers={} if self.query_sampler is None else dict(query=self.query_sampler),
            model=(self.reward_model, self.reward_model.hparams, self.reward_model.trained_model.encoding))
        if state:
            self.global_step, self.train_indices = state.step, state.extra['train_indices']
            self.results, self.done = state.extra['results'], state.extra['done']
        return bool(state)


def train(hparams: HParams):
    """Ours: returns RewardModelTrainer.train()'s results; rerun on the same save dir, it resumes there. In order: the
    checks, the save dir, the execution, the models, the data, the trainer, the loop (its train(): the labels)."""
    run_checks.check_reward(hparams, ranks.get_world_size())  # at launch already; here for callers of train()
    # Ours: the save dir (locked; a dir holding another run is refused), its files and stats (training/run.py).
    with Run(hparams, 'train_reward', may_change=RERUN_MAY_CHANGE) as run:
        utils.set_mpi_seed(hparams.run.seed)

        m = trained_models.TrainedModel(hparams.task.policy.initial_model)
        encoder = m.encoding.get_encoder()
        normalizing = hparams.normalize_before or hparams.normalize_after
        # Ours: bf16, the CUDA graph and the microbatch size ('auto': planned for the free memory), once.
        execution = Execution.prepare(hparams.run, memory.reward_passes(hparams), m.hparams(), resident=1 + normalizing,
                                      trained=1, what='train_reward',
                                      smallest=run_checks.samples_per_label(hparams.labels.type))

        # Built only for the normalizations (the original built them always, but TF read nothing unused)
        ref_policy = query_sampler = None
        if normalizing:
            ref_policy = Policy.for_task(m, hparams.task, scope='ref_policy').to(execution.device)
            ref_policy.requires_grad_(False)

        reward_model = rewards.RewardModelTrainer(m).to(execution.device)

        if ref_policy is not None:
            query_sampler = lm_tasks.make_query_sampler(
                hparams=hparams.task, encoder=encoder,
                batch_size=utils.exact_div(hparams.rollout_batch_size, ranks.get_world_size())
            )

        reward_trainer = RewardModelTrainer(
            reward_model=reward_model,
            policy=ref_policy,
            query_sampler=query_sampler,
            hparams=hparams,
            execution=execution,
            run=run,
        )

        # Every rank starts from rank 0's weights (the original's variable_synchronizer).
        if ref_policy is not None:
            utils.sync_params(ref_policy)
        utils.sync_params(reward_model)

        # Ours: the final save (as the original's, at the end), Ctrl-C, the curves and a summary.
        with run.training(step=lambda: reward_trainer.global_step, save=reward_trainer.save, next_steps=[
                f'use it:       python launch.py train_policy EXPERIMENT NAME --rewards.trained_model {run.model_dir} '
                '--rewards.train_new_model off', f'export:       python sample.py export --save_dir {run.save_dir} '
                '--savescope reward_model --out HF_DIR']):
            return reward_trainer.train()
