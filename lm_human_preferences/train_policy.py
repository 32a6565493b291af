#!/usr/bin/env python3
"""Fine-tune a policy with PPO against a reward model (port of the original train_policy.py; PORTING.md lists what
differs). Ours: the PPO math is in small functions (compute_rewards, compute_advantages, ppo_loss) that the tests
check against numpy; PPOTrainer shows where each is used."""

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from lm_human_preferences import lm_tasks, train_reward
from lm_human_preferences.language import sample, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.rewards import TrainedRewardModel
from lm_human_preferences.labeling.online_hparams import OnlineHParams
from lm_human_preferences.training import execution, memory, run_checks, train_state
from lm_human_preferences.training.adam import AdamTF
from lm_human_preferences.training.callbacks import Callbacks
from lm_human_preferences.training.execution import Execution
from lm_human_preferences.training.progress import Progress
from lm_human_preferences.training.run import Run
from lm_human_preferences.training.side_by_side import RankBlocks
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import finite, hyperparams, passes, ranks

# Ours: the hparams a rerun may change and still resume (training/run.Run): the port's run.* ones, and where the
# online loop serves its labeling page.
RERUN_MAY_CHANGE = execution.RERUN_MAY_CHANGE + ('online.host', 'online.port')


@dataclass
class AdaptiveKLParams(hyperparams.HParams):
    target: float = None
    horizon: int = 10000  # in episodes
    rules = dict(at_least_1=('horizon',))  # ours, as below: what a field allows, one line at launch (hyperparams)

    def validate(self, *, prefix=''):  # ours: AdaptiveKLController divides by both
        super().validate(prefix=prefix)
        hyperparams.require(hyperparams.positive(self.target), prefix + 'target', self.target,
                            'it must be a positive number (the KL the controller aims at)')


@dataclass
class RewardHParams(hyperparams.HParams):
    kl_coef: float = 0.2
    adaptive_kl: Optional[AdaptiveKLParams] = None

    trained_model: Optional[str] = None
    # Ours: accept a trained_model without a trained reward head (e.g. a policy), scoring with a random one.
    allow_untrained_head: bool = False

    train_new_model: Optional[train_reward.HParams] = None

    def validate(self, *, prefix=''):
        super().validate(prefix=prefix)
        # Ours: at least 0; with adaptive_kl positive.
        if self.adaptive_kl is None:
            hyperparams.require(hyperparams.nonnegative(self.kl_coef), prefix + 'kl_coef', self.kl_coef,
                                'it must be a number at least 0 (0: no KL penalty)')
        else:  # the controller only multiplies it: from 0 it never moves, and a negative one rewards the KL
            hyperparams.require(hyperparams.positive(self.kl_coef), prefix + 'kl_coef', self.kl_coef,
                                f'it must be a positive number with {prefix}adaptive_kl on (the controller only '
                                f'multiplies it: 0 stays 0)')
        # The original asserted these; a ValueError names the keys.
        if self.trained_model is not None and self.train_new_model is not None:
            raise ValueError(f'Cannot use trained_model and train new model: set only one of '
                             f'{prefix}trained_model and {prefix}train_new_model')
        if self.trained_model is None and self.train_new_model is None:
            raise ValueError(f'Need either trained_model or to train a new model: set '
                             f'{prefix}trained_model or {prefix}train_new_model')


@dataclass
class PpoHParams(hyperparams.HParams):
    total_episodes: int = 2000000
    batch_size: int = 64
    nminibatches: int = 1
    noptepochs: int = 4
    lr: float = 5e-6
    vf_coef: float = .1
    cliprange: float = .2
    cliprange_value: float = .2
    gamma: float = 1
    lam: float = 0.95
    whiten_rewards: bool = True
    rules = dict(at_least_1=('batch_size', 'nminibatches', 'noptepochs', 'total_episodes'),
                 positive=('lr', 'cliprange', 'cliprange_value'), nonnegative=('vf_coef',), fraction=('gamma', 'lam'))


@dataclass
class HParams(hyperparams.HParams):
    run: train_reward.RunHParams = field(default_factory=train_reward.RunHParams)

    task: lm_tasks.TaskHParams = field(default_factory=lm_tasks.TaskHParams)
    rewards: RewardHParams = field(default_factory=RewardHParams)
    ppo: PpoHParams = field(default_factory=PpoHParams)
    online: OnlineHParams = field(default_factory=OnlineHParams)  # ours: the online loop's (online/loop.py)

    def override_from_dict(self, flat_dict, separator='.'):
        """Ours: while rewards.train_new_model is on, a `task.X` value sets `rewards.train_new_model.task.X` too
        (unless the dict sets that one itself): the reward model is trained on the policy's task. So does `run.bf16`:
        one precision for the whole run (`--run.bf16 false` once left the reward phase in bf16 on CUDA)."""
        super().override_from_dict(flat_dict, separator=separator)
        if self.rewards.train_new_model is not None:
            reward_task = separator.join(('rewards', 'train_new_model', ''))
            both = {reward_task + k: v for k, v in flat_dict.items() if reward_task + k not in flat_dict and
                    (k.startswith('task' + separator) or k == separator.join(('run', 'bf16')))}
            if both:
                super().override_from_dict(both, separator=separator)

    def validate(self, *, prefix=''):
        super().validate(prefix=prefix)
        ppo = self.ppo
        # NOTE: must additionally divide by # ranks (run_checks.check_policy, at launch)
        hyperparams.require(ppo.batch_size % ppo.nminibatches == 0, f'{prefix}ppo.batch_size', ppo.batch_size,
                            f'it must be a multiple of {prefix}ppo.nminibatches {ppo.nminibatches}')
        minibatch_size = ppo.batch_size // ppo.nminibatches
        if ppo.whiten_rewards and minibatch_size < 8:
            raise ValueError(f"Minibatch size {minibatch_size} (ppo.batch_size / ppo.nminibatches) is "
                             f"insufficient for whitening in PPOTrainer.loss (needs >= 8): use "
                             f"--{prefix}ppo.batch_size {8 * ppo.nminibatches} or more, fewer "
                             f"--{prefix}ppo.nminibatches, or --{prefix}ppo.whiten_rewards false")
        run_checks.check_policy(self, 1, prefix=prefix)  # ours: across its parts, for one rank


def chain_reward_model(hparams: HParams):
    """The values train() derives when it trains the reward model first (the original set them in train): the reward
    phase saves into the policy's save dir, the policy loads <save_dir>/reward_model. Ours: the launcher sets them
    too, so that --dry_run shows them; the reward phase logs to wandb when the policy does."""
    if not hparams.rewards.train_new_model:
        return
    save_dir = hparams.run.save_dir
    if not save_dir:
        raise ValueError('rewards.train_new_model needs run.save_dir: the reward model is trained into '
                         '<save_dir>/reward_model and loaded from there')
    hparams.rewards.train_new_model.run.save_dir = save_dir
    hparams.rewards.trained_model = os.path.join(save_dir, 'reward_model')
    if hparams.run.wandb:  # in the policy's project: a group lives in one project
        hparams.rewards.train_new_model.run.wandb = True
        hparams.rewards.train_new_model.run.wandb_project = hparams.run.wandb_project


def nupdates(hparams):
    return utils.ceil_div(hparams.ppo.total_episodes, hparams.ppo.batch_size)


def policy_frac(hparams, global_step):
    """How far we are through policy training (the original read TF's global step variable)."""
    return global_step / nupdates(hparams)


class FixedKLController:
    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current, n_steps):
        pass


class AdaptiveKLController:
    def __init__(self, init_kl_coef, hparams):
        self.value = init_kl_coef
        self.hparams = hparams

    def update(self, current, n_steps):
        target = self.hparams.target
        proportional_error = np.clip(float(current) / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / self.hparams.horizon
        self.value = float(self.value * mult)


# ---------------------------------------------------------------------------------------------------
# PPO math, fp32 throughout (tests/test_ppo_math.py checks each against numpy).

def compute_rewards(*, scores, logprobs, ref_logprobs, kl_coef):
    """Per-token rewards: a KL penalty at every token, plus the score at the last token."""
    kl = logprobs - ref_logprobs
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[:, -1] += scores
    return rewards, non_score_reward


def compute_advantages(*, rewards, values, gamma, lam, whiten_rewards, ranks=1):
    """GAE on one minibatch. Returns (whitened advantages, returns); returns use the raw advantages.
    ranks (ours): the minibatches of that many ranks side by side, rows grouped by rank, each whitened over
    its own rows as each of the original's ranks whitened its own minibatch."""
    if whiten_rewards:
        # shift_mean=False: normalize the scale but keep the mean reward.
        rewards = utils.whiten(rewards, shift_mean=False, groups=ranks)

    # The TD errors of all tokens at once (the same fp32 operations as the original's per-token ones). The
    # episode ends after the last response token: its next value is 0.
    nextvalues = F.pad(values[:, 1:], (0, 1))
    deltas = rewards + gamma * nextvalues - values  # [b, response_length]
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        lastgaelam = deltas[:, t] + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values  # value targets, from the advantages before whitening

    advantages = utils.whiten(advantages, groups=ranks)
    return advantages.detach(), returns.detach()


def ppo_loss(*, logprob, vpred, entropies, old_logprob, old_values, advantages, returns,
             cliprange, cliprange_value, vf_coef, mean=torch.mean):
    """Clipped PPO policy loss + vf_coef * clipped value loss (no entropy bonus), and its stats: means
    over the elements given (a minibatch). Ours: `mean` is the reduction; PPOTrainer.loss takes the mean of
    each row (an episode), then each rank's mean of its rows' means, which is the same."""
    # Value loss, clipped around the old values: 0.5 * mean(max(unclipped^2, clipped^2)).
    vpredclipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    vf_loss = .5 * mean(torch.maximum(vf_losses1, vf_losses2))
    vf_clipfrac = mean((vf_losses2 > vf_losses1).float())  # strict >, as tf.greater

    # Policy loss: ratio of new to old (sampling-time) probabilities, clipped to 1 +- cliprange.
    ratio = torch.exp(logprob - old_logprob)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = mean(torch.maximum(pg_losses, pg_losses2))
    pg_clipfrac = mean((pg_losses2 > pg_losses).float())

    loss = pg_loss + vf_coef * vf_loss

    entropy = mean(entropies)
    approxkl = .5 * mean(torch.square(logprob - old_logprob))

    stats = dict(
        loss=dict(policy=pg_loss, value=vf_loss, total=loss),
        policy=dict(entropy=entropy, approxkl=approxkl, clipfrac=pg_clipfrac),
        val=dict(vpred=mean(vpred), error=mean((vpred - returns) ** 2), clipfrac=vf_clipfrac),
    )
    stats = {k: v.detach().float() for k, v in utils.flatten_dict(stats, sep='/').items()}
    return loss, stats


def minibatch_moments(*, returns, old_values, ranks=1):
    """The original's returns/{mean,var} and val/{mean,var} stats of a minibatch (tf.nn.moments: mean and
    population variance over all elements); they need no model, so they are taken over the whole minibatch
    even when its loss is computed in microbatches. Ours: [ranks] each, one per rank of `ranks` side by side
    (rows grouped by rank), over its own rows."""
    stats = {}
    for name, x in (('returns', returns), ('val', old_values)):
        mean, var = utils.moments(x.reshape(ranks, -1), dim=1)
        stats[f'{name}/mean'], stats[f'{name}/var'] = mean.view(ranks), var.view(ranks)
    return {k: v.detach().float() for k, v in stats.items()}


class PPOTrainer:
    def __init__(self, *, policy, ref_policy, query_sampler, score_fn, hparams, run, execution=None):
        self.policy = policy
        self.ref_policy = ref_policy
        self.score_fn = score_fn
        self.hparams = hparams
        # Ours: the device, bf16 (forward passes only: all PPO math in fp32), the microbatch size and the CUDA
        # graph, resolved once (training/execution.py).
        self.execution = execution or Execution.of(hparams.run)
        self.device = self.execution.device
        # PPO batches done so far: the learning-rate schedule, logging and checkpoints count these.
        self.global_step = 0

        if hparams.rewards.adaptive_kl is None:
            self.kl_ctl = FixedKLController(hparams.rewards.kl_coef)
        else:
            self.kl_ctl = AdaptiveKLController(hparams.rewards.kl_coef, hparams=hparams.rewards.adaptive_kl)

        # Counted, so that a resumed run continues each rank's query stream where it was (see train()'s save()).
        self.query_sampler = train_state.CountingSampler(query_sampler)
        self.sample_queries = lambda: self.query_sampler()['tokens'].to(self.device)

        # per rank sizes
        self.per_rank_rollout_batch_size = utils.exact_div(hparams.ppo.batch_size, ranks.get_world_size())
        self.per_rank_minibatch_size = utils.exact_div(self.per_rank_rollout_batch_size, hparams.ppo.nminibatches)
        # Ours: the ranks this process carries, side by side in every batch: rank local_ranks()[i] holds
        # rows i * per_rank .. (i + 1) * per_rank - 1 (training/side_by_side.py).
        self.ranks = RankBlocks()

        # TF1's AdamOptimizer(epsilon=1e-5) (see AdamTF); the lr is set before every minibatch.
        self.optimizer = AdamTF(self.policy.parameters(), lr=hparams.ppo.lr, eps=1e-5)

        self.run = run  # ours: the training/run.Run that logs the stats (train() saves and resumes with it)
        self.progress = None  # ours: the `[ppo_step]` line's total and ETA, from the first step run
        self.rollout_forward = None  # ours, bf16 mode: see forward_for_first_minibatch
        # elapsed/time and elapsed/fps (the original's tf_times): since start and since the last batch.
        self.start_time = self.last_time = time.time()

    def step(self):
        """One PPO batch. Ours: the ranks this process carries run side by side, as row blocks of one batch
        (utils/ranks.py), each with its own queries, random streams, whitening and stats."""
        hparams = self.hparams
        step_started_at = time.time()

        # KL-penalized per-token rewards use this batch's KL coefficient.
        kl_coef = self.kl_ctl.value
        rollouts, data = self.rollout(kl_coef)

        train_stats = self.train(rollouts)

        stats = self.record_step_stats(kl_coef=kl_coef, data=data, train_stats=train_stats)

        # Adaptive KL: once per batch, from the KL averaged over all ranks; n_steps = the global batch.
        self.kl_ctl.update(stats['objective/kl'], hparams.ppo.batch_size)

        # Rank 0's samples (the process that prints carries rank 0 first: its rows come first).
        self.print_samples(queries=rollouts['queries'], responses=data['postprocessed_responses'],
                           scores=data['scores'], logprobs=data['logprobs'], ref_logprobs=data['ref_logprobs'])

        # Record profiles of the step times
        step_time = time.time() - step_started_at
        eps_per_second = float(hparams.ppo.batch_size) / step_time
        if self.progress is None:
            self.progress = Progress(nupdates(hparams), start=self.global_step, started=step_started_at)
        self.progress.done = self.global_step + 1
        if ranks.is_root():
            # Ours: how many of how many are done (a count: step 0 done is 1 done), and the ETA.
            print(f"[ppo_step {self.global_step}] step_time={step_time:.2f}s, "
                  f"eps/s={eps_per_second:.2f} ({self.progress()})")
        return stats

    def rollout(self, kl_coef):
        """The original's rollout of step(), every rank's side by side: (rollouts, the minibatches' data; data, for the
        stats and the samples printed), rows grouped by rank."""
        hparams = self.hparams
        microbatch_size = self.execution.microbatch_size

        # Ours: each rank's queries and sampling draws, from its own query shard and streams.
        queries, uniforms = ranks.concat_ranks(lambda: sample.queries_and_draws(
            self.sample_queries(), hparams.task.response_length))

        with torch.no_grad(), self.execution.autocast():
            rollouts = self.policy.respond(queries, length=hparams.task.response_length, uniforms=uniforms,
                                           execution=self.execution)
        responses = rollouts['responses']
        if self.execution.bf16:
            # Ours: under bf16 the old logprobs and values are the loss's forward's, so that the ratio starts at 1
            rollouts = dict(rollouts, **self.forward_for_first_minibatch(queries, responses))
        with torch.no_grad(), self.execution.autocast():
            ref_logprobs = passes.microbatched(
                self.ref_policy.analyze_responses, microbatch_size, queries, responses)['logprobs']
            # Scored: the postprocessed (truncated) responses; PPO trains on the untruncated ones.
            scores, postprocessed_responses, score_stats = self.score_fn(queries, responses)
        logprobs = rollouts['logprobs'].float()
        ref_logprobs = ref_logprobs.float()
        scores = scores.float()
        score_stats = {k: v.float() for k, v in score_stats.items()}
        finite.check_finite(self.global_step, scores=scores)  # ours: a broken reward model stops here

        rewards, non_score_reward = compute_rewards(
            scores=scores, logprobs=logprobs, ref_logprobs=ref_logprobs, kl_coef=kl_coef)
        rollouts = dict(queries=queries, responses=responses, values=rollouts['values'].float(),
                        logprobs=logprobs, rewards=rewards)
        data = dict(scores=scores, logprobs=logprobs, ref_logprobs=ref_logprobs, non_score_reward=non_score_reward,
                    score_stats=score_stats, postprocessed_responses=postprocessed_responses)
        return rollouts, data

    def forward_for_first_minibatch(self, queries, responses):
        """Ours, bf16 mode: the "old" logprobs and values by the loss's forward; its graph kept where the first
        minibatch is the whole batch in one pass, so that train() does not run it twice."""
        whole = self.hparams.ppo.nminibatches == 1 and len(passes.microbatches(len(queries),
                                                                              self.execution.microbatch_size)) == 1
        with torch.set_grad_enabled(whole), self.execution.autocast():
            outputs = passes.microbatched(self.policy.analyze_responses, self.execution.microbatch_size,
                                         queries, responses)
        self.rollout_forward = outputs if whole else None
        return dict(logprobs=outputs['logprobs'].detach(), values=outputs['values'].detach())

    def train(self, rollouts):
        """Each rank's stats, [ranks, number of minibatches] per key (rows grouped by rank)."""
        per_rank = self.per_rank_rollout_batch_size
        forward, self.rollout_forward = self.rollout_forward, None  # ours: the first minibatch's, if kept
        stat_list = []
        for ppo_epoch_idx in range(self.hparams.ppo.noptepochs):
            # A fresh shuffle each epoch from numpy's global RNG, as the original: each rank draws its own
            # order of its own rollouts, from its own stream (seeded by set_mpi_seed).
            orders = self.ranks.permutations(per_rank, self.device)  # [ranks, per_rank], rows of the batch
            for mb_start in range(0, per_rank, self.per_rank_minibatch_size):
                # Every rank's minibatch, side by side
                mb_indices = orders[:, mb_start:mb_start + self.per_rank_minibatch_size].reshape(-1)
                minibatch = {k: v[mb_indices] for k, v in rollouts.items()}
                kept = None if forward is None else {k: v[mb_indices] for k, v in forward.items()}
                forward = None
                stat_list.append(self.train_minibatch(minibatch, forward=kept))
        # Collect the stats. (They will be averaged later.)
        return {k: torch.stack([s[k] for s in stat_list], dim=1) for k in stat_list[0].keys()}

    def train_minibatch(self, minibatch, forward=None):
        """One step of PPO training: each rank's stats, [ranks] per key. forward (ours): the policy's outputs on
        these rows, kept from the rollout (forward_for_first_minibatch)."""
        # Linear lr decay by PPO batch: constant within a batch's epochs and minibatches.
        lrnow = self.hparams.ppo.lr * (1 - policy_frac(self.hparams, self.global_step))
        for group in self.optimizer.param_groups:
            group['lr'] = lrnow

        self.optimizer.zero_grad(set_to_none=True)
        stats = self.loss(minibatch, forward=forward)
        # The gradients' mean over ranks (the original's allreduce in `minimize`); no gradient clipping.
        utils.mpi_allreduce_mean_grads(self.policy.parameters())
        # Ours: stop before a non-finite update is applied (and so before it could be saved).
        finite.check_finite(self.global_step, **finite.per_rank('loss', stats['loss/total']),
                           grad_norm=finite.grad_norm(self.policy.parameters()))
        self.optimizer.step()
        return stats

    def loss(self, rollouts, forward=None):
        """Every rank's PPO loss on its minibatch, back-propagated (the gradient of the ranks' mean loss); each rank's
        stats, [ranks] per key. Ours: the policy's passes in microbatches of at most run.microbatch_size, each
        back-propagated at once; whitening and GAE still over each rank's whole minibatch."""
        ppo = self.hparams.ppo
        ranks = self.ranks.count
        values = rollouts['values']
        old_logprob = rollouts['logprobs']
        # Per minibatch and per rank, as the original: reward whitening, GAE, advantage whitening.
        advantages, returns = compute_advantages(
            rewards=rollouts['rewards'], values=values, gamma=ppo.gamma, lam=ppo.lam,
            whiten_rewards=ppo.whiten_rewards, ranks=ranks)

        n = len(values)
        row_stats = []
        for piece in passes.microbatches(n, self.execution.microbatch_size):
            outputs = forward
            if outputs is None:
                with self.execution.autocast():
                    outputs = self.policy.analyze_responses(rollouts['queries'][piece], rollouts['responses'][piece])
            # Each episode's (row's) means: a rank's loss and stats, means over its minibatch's elements,
            # are the means of its rows'.
            loss, stats = ppo_loss(
                logprob=outputs['logprobs'].float(), vpred=outputs['values'].float(),
                entropies=outputs['entropies'].float(), old_logprob=old_logprob[piece], old_values=values[piece],
                advantages=advantages[piece], returns=returns[piece],
                cliprange=ppo.cliprange, cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef,
                mean=lambda x: x.mean(dim=1))
            # The mean over ranks of their mean losses is the mean over all rows (each rank has n / ranks).
            (loss.sum() / n).backward()
            row_stats.append(stats)
        stats = {k: self.ranks.view(torch.cat([s[k] for s in row_stats])).mean(dim=1) for k in row_stats[0]}
        stats.update(minibatch_moments(returns=returns, old_values=values, ranks=ranks))
        return stats

    def record_step_stats(self, *, kl_coef, data, train_stats):
        """Each rank's stats of this batch as the original's, averaged over all ranks, logged; returns them."""
        hparams = self.hparams
        by_rank = self.ranks.view  # [ranks * per_rank, ...] -> [ranks, per_rank, ...]

        kl = by_rank(data['logprobs'] - data['ref_logprobs'])
        mean_kl = torch.mean(torch.sum(kl, dim=2), dim=1)
        # sampled logprobs: a one-sample estimate
        mean_entropy = torch.mean(torch.sum(-by_rank(data['logprobs']), dim=2), dim=1)
        mean_non_score_reward = torch.mean(torch.sum(by_rank(data['non_score_reward']), dim=2), dim=1)
        stats = {
            'objective/kl': mean_kl,
            'objective/kl_coef': torch.full_like(mean_kl, kl_coef),
            'objective/entropy': mean_entropy,
        }
        for k, v in train_stats.items():
            stats[f'ppo/{k}'] = torch.mean(v, dim=1)
        for k, v in data['score_stats'].items():
            mean = torch.mean(by_rank(v), dim=1)
            stats[f'objective/{k}'] = mean
            stats[f'objective/{k}_total'] = mean + mean_non_score_reward
        # The original's FlatStats (by name) mean over ranks.
        stats = self.ranks.mean(dict(sorted(stats.items())))

        # Add more statistics (from the averaged ones)
        step = self.global_step
        stats['ppo/val/var_explained'] = 1 - stats['ppo/val/error'] / stats['ppo/returns/var']
        steps = step + 1
        stats.update({
            'elapsed/updates': steps,
            'elapsed/steps/serial': steps * hparams.task.response_length,
            'elapsed/steps/total': steps * hparams.ppo.batch_size * hparams.task.response_length,
            'elapsed/episodes': steps * hparams.ppo.batch_size,
        })

        # Time statistics
        now = time.time()
        total, delta = now - self.start_time, now - self.last_time
        self.last_time = now
        stats.update({
            'elapsed/fps': int(hparams.ppo.batch_size * hparams.task.response_length / delta),
            'elapsed/time': total,
        })

        # The original's table every log_interval batches, with a save dir or not; ours: JSONL, wandb too.
        return self.run.stats.log(stats, step)

    def print_samples(self, queries, responses, scores, logprobs, ref_logprobs):
        if not ranks.is_root():
            return
        if self.global_step % self.hparams.run.log_interval != 0:
            return

        encoder = self.policy.encoder

        # Log samples (rank 0's: the first rows)
        for i in range(min(3, self.per_rank_rollout_batch_size)):
            sample_kl = torch.sum(logprobs[i] - ref_logprobs[i]).item()
            score = scores[i].item()
            print(encoder.decode(queries[i][:self.hparams.task.query_length].tolist()).replace("\n", "⏎"))
            print(encoder.decode(responses[i].tolist()).replace("\n", "⏎"))
            print(f"  score = {score:+.2f}")
            print(f"  kl = {sample_kl:+.2f}")
            # As the original: the initial kl_coef, not the adaptive controller's current value.
            print(f"  total = {score - self.hparams.rewards.kl_coef * sample_kl:+.2f}")


def make_score_fn(hparams, score_model, microbatch_size=None):
    """score_fn(queries, responses) -> (scores, postprocessed responses, stats): the reward model on
    the postprocessed responses (ours: at most microbatch_size at a time); a response that fails the
    filter gets exactly penalty_reward_value."""
    padding_token = score_model.padding_token

    postprocess = lm_tasks.postprocess_fn_from_hparams(hparams, padding_token)
    filter_fn = lm_tasks.filter_fn_from_hparams(hparams)

    def penalize(responses, rewards):
        valid = filter_fn(responses)
        return torch.where(valid, rewards, torch.full_like(rewards, hparams.penalty_reward_value))

    def score_fn(queries, responses):
        responses = postprocess(responses)
        score = penalize(responses, passes.microbatched(score_model.score_fn, microbatch_size, queries, responses))
        return score, responses, dict(score=score)
    return score_fn


def resume(run, ppo_trainer, m):
    """Ours: restore ppo_trainer from the run's last training state, if any; returns save(): the model checkpoint
    (as the original) and the training state (training/run.py)."""
    policy = ppo_trainer.policy
    state = run.resume(modules=dict(policy=policy), optimizer=ppo_trainer.optimizer,
                       samplers=dict(query=ppo_trainer.query_sampler), model=(policy, m.hparams(), m.encoding))
    if state:
        ppo_trainer.global_step = state.step
        ppo_trainer.kl_ctl.value = state.extra['kl_coef']

    def save():
        run.save(ppo_trainer.global_step, extra=dict(kl_coef=ppo_trainer.kl_ctl.value),
                 done=ppo_trainer.global_step == nupdates(ppo_trainer.hparams))
    return save


def train(hparams: HParams, callbacks=()):
    """Ours: rerun with the same hparams and save dir, it resumes from the last training states there. In order: the
    checks, the save dir, the reward model, the execution, the models, the data, the trainer, the loop. callbacks:
    what a caller adds to the loop (training/callbacks.py; the online loop, online/loop.py)."""
    if hparams.online.retrains and not callbacks:  # ours: else the run would go on without its rounds
        raise ValueError(f'online.retrains {hparams.online.retrains}: the online loop runs them as its callback '
                         f'(online/loop.train, which launch.py runs), not train_policy.train alone')
    run_checks.check_policy(hparams, ranks.get_world_size())  # at launch already; here for callers of train()
    # The original swapped in a random 'test' reward model under pytest; we always load the one trained.
    chain_reward_model(hparams)

    # Ours: the save dir (locked; a dir holding another run is refused), its files and stats (training/run.py).
    with Run(hparams, 'train_policy', may_change=RERUN_MAY_CHANGE) as run:
        if hparams.rewards.train_new_model:
            train_reward.train(hparams.rewards.train_new_model)
            utils.mpi_bcast(None)  # rank 0 saved the reward model: every process waits for it

        m = trained_models.TrainedModel(hparams.task.policy.initial_model)
        encoder = m.encoding.get_encoder()

        utils.set_mpi_seed(hparams.run.seed)

        # Ours: bf16, the CUDA graph and the microbatch size ('auto': planned for the free memory), once.
        execution = Execution.prepare(hparams.run, memory.policy_passes(hparams), m.hparams(), **memory.POLICY_MODELS,
                                      what='train_policy')
        score_model = TrainedRewardModel(hparams.rewards.trained_model, m.encoding,
                                         allow_untrained_head=hparams.rewards.allow_untrained_head).to(execution.device)
        ref_policy = Policy.for_task(m, hparams.task, scope='ref_policy').to(execution.device)
        policy = Policy.for_task(m, hparams.task, scope='policy').to(execution.device)

        # Only the policy is trained.
        score_model.requires_grad_(False)
        ref_policy.requires_grad_(False)

        query_sampler = lm_tasks.make_query_sampler(
            hparams=hparams.task, encoder=encoder,
            batch_size=utils.exact_div(hparams.ppo.batch_size, ranks.get_world_size()),
        )
        run.record_data('queries', query_sampler.fingerprint)  # ours: a rerun on other queries is refused

        ppo_trainer = PPOTrainer(
            policy=policy, ref_policy=ref_policy, query_sampler=query_sampler,
            score_fn=make_score_fn(hparams.task, score_model=score_model, microbatch_size=execution.microbatch_size),
            hparams=hparams, execution=execution, run=run)

        # sync_models: every rank starts from rank 0's weights (for random 'test' models they differ).
        utils.sync_params(list(score_model.parameters()) + list(ref_policy.parameters()) + list(policy.parameters()))

        # Ours: a rerun resumes from the save dir's last training state.
        save = resume(run, ppo_trainer, m)
        callbacks = Callbacks(callbacks, ppo_trainer=ppo_trainer, score_model=score_model, run=run, save=save,
                              restore=lambda: resume(run, ppo_trainer, m))

        # Ours: the original's `finally: save()`, Ctrl-C, the learning curves and a summary (training/run.py).
        next_steps = [f'sample:       python sample.py sample --save_dir {run.save_dir} --nsamples 8',
                      f'export:       python sample.py export --save_dir {run.save_dir} --out HF_DIR']
        with run.training(step=lambda: ppo_trainer.global_step, save=save, next_steps=next_steps), \
                callbacks.around_training():
            while ppo_trainer.global_step < nupdates(hparams):
                callbacks.on_step_begin()
                ppo_trainer.step()
                ppo_trainer.global_step += 1

                if run.save_due(ppo_trainer.global_step):  # every run.save_interval steps, and on a stop signal
                    save()
