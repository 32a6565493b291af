"""Ours: the values a run cannot use, each one line naming the hparam (or option) and what is allowed, before any
work: the trainers' HParams.validate() calls these beside the original's own checks, and launch.py's launch_trials
the rank checks (check_reward_ranks, check_policy_ranks) for its --mpi. The original asserted a few of them inside
its trainers, after the models were built (PORTING.md: Checks the original did not have)."""

from lm_human_preferences import label_types
from lm_human_preferences.utils import core, hyperparams


def check_run_hparams(run, *, prefix=''):
    """train_reward.RunHParams (train_policy's too): what the run cannot use."""
    for name in ('save_interval', 'log_interval'):
        hyperparams.require(getattr(run, name) > 0, prefix + name, getattr(run, name), 'it must be at least 1')
    check_seed(run, 1, prefix=prefix)


def check_seed(run, num_ranks, *, prefix=''):
    """Ours (at launch; numpy's message named no option): every rank's seed must be one numpy takes."""
    top = 2 ** 32 - 1 - 100003 * (num_ranks - 1)  # rank r's: seed + 100003 * r (utils/ranks.seed)
    hyperparams.require(run.seed is None or 0 <= run.seed <= top, prefix + 'seed', run.seed,
                        f'it must be from 0 to {top}' + (f' with --mpi {num_ranks}' if num_ranks > 1 else '')
                        + ': rank r seeds numpy (0 to 2**32 - 1) with seed + 100003 * r; unset: fresh entropy')


def check_reward_hparams(hparams, *, prefix=''):
    """train_reward.HParams: the values a run cannot use, in one line each, at launch (the original met some of them
    as an assert or a division deep inside the run, and ran with others: batch_size -8 trained 0 steps)."""
    require, positive = hyperparams.require, hyperparams.positive
    for name in ('batch_size', 'rollout_batch_size'):
        require(getattr(hparams, name) > 0, prefix + name, getattr(hparams, name), 'it must be at least 1')
    require(hparams.labels.num_train > 0, prefix + 'labels.num_train', hparams.labels.num_train,
            'it must be at least 1')
    for name in ('normalize_samples', 'debug_normalize'):
        require(getattr(hparams, name) >= 0, prefix + name, getattr(hparams, name), 'it must be at least 0')
    require(positive(hparams.lr), prefix + 'lr', hparams.lr, 'it must be a positive number')
    try:
        label_types.get(hparams.labels.type)
    except ValueError as e:
        raise hyperparams.HParamValueError(f"hyperparameter '{prefix}labels.type': {e}") from None
    require(hparams.labels.num_train % hparams.batch_size == 0, prefix + 'labels.num_train', hparams.labels.num_train,
            f'it must be a multiple of {prefix}batch_size {hparams.batch_size} (one epoch of whole minibatches)')
    microbatch_size = hparams.run.microbatch_size
    if microbatch_size not in (None, 'auto'):
        # The label type's loss compares a label's samples in one pass: they share a microbatch.
        per_label = samples_per_label(hparams.labels.type)
        if microbatch_size < per_label:
            raise ValueError(f'{prefix}run.microbatch_size {microbatch_size} is smaller than the {per_label} '
                             f'sequences of one {hparams.labels.type} label (its query with each sample), which '
                             f'the reward model scores in one pass: use at least {per_label}')


def check_reward_ranks(hparams, num_ranks, *, prefix=''):
    """Ours, at launch: the sizes each of num_ranks ranks takes a share of must split evenly."""
    check_seed(hparams.run, num_ranks, prefix=prefix + 'run.')
    sizes = ['batch_size'] + (['rollout_batch_size'] if hparams.normalize_before or hparams.normalize_after else [])
    for name in sizes:
        hyperparams.require(getattr(hparams, name) % num_ranks == 0, prefix + name, getattr(hparams, name),
                            splits_over(num_ranks))


def splits_over(num_ranks, parts=1, of=''):
    """The one-line rule for a size that num_ranks ranks (and `parts` pieces `of` something each) share."""
    return (f'each of the --mpi {num_ranks} ranks takes an equal share{of}: choose a multiple of {num_ranks * parts} '
            f'(or another --mpi)')


def samples_per_label(label_type):
    """Ours: the samples one label of this type compares (its question's fields but the query), each a
    sequence the reward model scores."""
    return len(label_types.get(label_type).question_schemas(query_length=1, response_length=1)) - 1


def check_adaptive_kl(adaptive_kl, *, prefix=''):
    """train_policy.AdaptiveKLParams: AdaptiveKLController divides by both."""
    hyperparams.require(hyperparams.positive(adaptive_kl.target), prefix + 'target', adaptive_kl.target,
                        'it must be a positive number (the KL the controller aims at)')
    hyperparams.require(adaptive_kl.horizon > 0, prefix + 'horizon', adaptive_kl.horizon, 'it must be at least 1')


def check_kl_coef(rewards, *, prefix=''):
    """train_policy.RewardHParams.kl_coef: at least 0, and positive with adaptive_kl."""
    if rewards.adaptive_kl is None:
        hyperparams.require(hyperparams.nonnegative(rewards.kl_coef), prefix + 'kl_coef', rewards.kl_coef,
                            'it must be a number at least 0 (0: no KL penalty)')
    else:
        # The controller only multiplies it: from 0 it never moves, and a negative one rewards the KL.
        hyperparams.require(hyperparams.positive(rewards.kl_coef), prefix + 'kl_coef', rewards.kl_coef,
                            f'it must be a positive number with {prefix}adaptive_kl on (the controller only '
                            f'multiplies it: 0 stays 0)')


def check_policy_hparams(hparams, *, prefix=''):
    """train_policy.HParams: the reward model's task is the policy's (check_reward_task); the values a run
    cannot use, in one line each, at launch."""
    check_reward_task(hparams, prefix=prefix)
    ppo, require = hparams.ppo, hyperparams.require
    for name in ('batch_size', 'nminibatches', 'noptepochs', 'total_episodes'):
        require(getattr(ppo, name) > 0, f'{prefix}ppo.{name}', getattr(ppo, name), 'it must be at least 1')
    require(hyperparams.positive(ppo.lr), f'{prefix}ppo.lr', ppo.lr, 'it must be a positive number')
    for name in ('cliprange', 'cliprange_value'):
        require(hyperparams.positive(getattr(ppo, name)), f'{prefix}ppo.{name}', getattr(ppo, name),
                'it must be a positive number')
    require(hyperparams.nonnegative(ppo.vf_coef), f'{prefix}ppo.vf_coef', ppo.vf_coef,
            'it must be a number at least 0')
    for name in ('gamma', 'lam'):
        require(hyperparams.fraction(getattr(ppo, name)), f'{prefix}ppo.{name}', getattr(ppo, name),
                'it must be a number from 0 to 1')
    adaptive_kl = hparams.rewards.adaptive_kl
    if adaptive_kl is not None:
        # Each batch multiplies kl_coef by 1 + e * ppo.batch_size / horizon, e in [-0.2, 0.2]: at or
        # under batch_size / 5 a batch could zero it or flip its sign.
        require(5 * adaptive_kl.horizon > ppo.batch_size, f'{prefix}rewards.adaptive_kl.horizon',
                adaptive_kl.horizon,
                f'it must be more than {prefix}ppo.batch_size {ppo.batch_size} / 5 (each batch the controller '
                f'multiplies {prefix}rewards.kl_coef by down to 1 - 0.2 * batch_size / horizon, which must '
                f'stay positive)')


def check_reward_task(hparams, *, prefix=''):
    """The reward model trained here (rewards.train_new_model) learns from samples of the policy's task,
    so its task must be the policy's (the original asserted `hparams.task == ...task` in train, printing
    both reprs): one line naming the first field that differs."""
    if hparams.rewards.train_new_model is None:
        return
    ours = core.flatten_dict(hparams.task.to_nested_dict(), sep='.')
    theirs = core.flatten_dict(hparams.rewards.train_new_model.task.to_nested_dict(), sep='.')
    differ = [k for k in ours if ours[k] != theirs[k]]
    if differ:
        k = differ[0]
        also = f' (also differing: {", ".join(differ[1:])})' if len(differ) > 1 else ''
        raise hyperparams.HParamValueError(
            f"hyperparameter '{prefix}rewards.train_new_model.task.{k}' is {theirs[k]!r} but '{prefix}task.{k}' is "
            f"{ours[k]!r}: the reward model is trained on the policy's task, they must be equal (--task.{k} "
            f"alone sets both){also}")


def check_policy_ranks(hparams, num_ranks):
    """Ours, at launch (the original asserted the last one inside train): the batches each of num_ranks ranks
    takes a share of must split evenly, and a rank's minibatch must hold 8 episodes to whiten over."""
    check_seed(hparams.run, num_ranks, prefix='run.')
    ppo = hparams.ppo
    hyperparams.require(ppo.batch_size % (num_ranks * ppo.nminibatches) == 0, 'ppo.batch_size', ppo.batch_size,
                        splits_over(num_ranks, ppo.nminibatches,
                                    of=f' of each of the ppo.nminibatches {ppo.nminibatches} minibatches'))
    per_rank_minibatch_size = ppo.batch_size // (num_ranks * ppo.nminibatches)
    if ppo.whiten_rewards and per_rank_minibatch_size < 8:
        # Ours: the fixes (the ranks that fit this batch size: those that split it into minibatches of 8+).
        fitting_ranks = [r for r in range(1, num_ranks) if ppo.batch_size % (r * ppo.nminibatches) == 0
                         and ppo.batch_size // (r * ppo.nminibatches) >= 8]
        raise ValueError(f"Per-rank minibatch size {per_rank_minibatch_size} is insufficient for whitening "
                         f"(ppo.batch_size / (ppo.nminibatches * --mpi {num_ranks} ranks) must be >= 8): use "
                         f"--ppo.batch_size {8 * ppo.nminibatches * num_ranks} or more"
                         + (f", --mpi {fitting_ranks[-1]}" if fitting_ranks else '')
                         + ", or --ppo.whiten_rewards false")
    if hparams.rewards.train_new_model:
        check_reward_ranks(hparams.rewards.train_new_model, num_ranks, prefix='rewards.train_new_model.')
