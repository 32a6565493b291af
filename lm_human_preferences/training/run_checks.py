"""Ours: the checks that need two hparams objects, or the number of ranks, in one place; each names the hparam (or
option) and what is allowed in one line, before any work. Each HParams class checks its own fields beside them
(its validate()); the trainers' top-level validate() then calls check_reward or check_policy for one rank, and
launch.py (for its --mpi) and the trainers' train() (for the world size) call them for theirs. The original asserted
a few of them inside its trainers, after the models were built (PORTING.md: Checks the original did not have)."""

from lm_human_preferences import label_types
from lm_human_preferences.utils import hyperparams


def check_seed(run, num_ranks, *, prefix=''):
    """Ours (at launch; numpy's message named no option): every rank's seed must be one numpy takes."""
    top = 2 ** 32 - 1 - 100003 * (num_ranks - 1)  # rank r's: seed + 100003 * r (utils/ranks.seed)
    hyperparams.require(run.seed is None or 0 <= run.seed <= top, prefix + 'seed', run.seed,
                        f'it must be from 0 to {top}' + (f' with --mpi {num_ranks}' if num_ranks > 1 else '')
                        + ': rank r seeds numpy (0 to 2**32 - 1) with seed + 100003 * r; unset: fresh entropy')


def check_reward(hparams, num_ranks, *, prefix=''):
    """train_reward.HParams across its parts (the original met labels.num_train % batch_size as an exact_div, and
    ran with others), and the sizes each of num_ranks ranks takes a share of, which must split evenly."""
    hyperparams.require(hparams.labels.num_train % hparams.batch_size == 0, prefix + 'labels.num_train',
                        hparams.labels.num_train, f'it must be a multiple of {prefix}batch_size {hparams.batch_size} '
                        f'(one epoch of whole minibatches)')
    microbatch_size = hparams.run.microbatch_size
    if microbatch_size not in (None, 'auto'):
        # The label type's loss compares a label's samples in one pass: they share a microbatch.
        per_label = samples_per_label(hparams.labels.type)
        if microbatch_size < per_label:
            raise ValueError(f'{prefix}run.microbatch_size {microbatch_size} is smaller than the {per_label} '
                             f'sequences of one {hparams.labels.type} label (its query with each sample), which '
                             f'the reward model scores in one pass: use at least {per_label}')
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


def check_policy(hparams, num_ranks, *, prefix=''):
    """train_policy.HParams across its parts: the reward model trained here learns from samples of the policy's
    task (check_reward_task), adaptive_kl's horizon against ppo.batch_size; then the batches each of num_ranks ranks
    takes a share of, which must split evenly, a rank's minibatch of 8 episodes or more to whiten over (the original
    asserted it inside train), and the reward model's (check_reward)."""
    check_reward_task(hparams, prefix=prefix)
    ppo, adaptive_kl = hparams.ppo, hparams.rewards.adaptive_kl
    if adaptive_kl is not None:
        # Each batch multiplies kl_coef by 1 + e * ppo.batch_size / horizon, e in [-0.2, 0.2]: at or
        # under batch_size / 5 a batch could zero it or flip its sign.
        hyperparams.require(5 * adaptive_kl.horizon > ppo.batch_size, f'{prefix}rewards.adaptive_kl.horizon',
                            adaptive_kl.horizon,
                            f'it must be more than {prefix}ppo.batch_size {ppo.batch_size} / 5 (each batch the '
                            f'controller multiplies {prefix}rewards.kl_coef by down to 1 - 0.2 * batch_size / horizon, '
                            f'which must stay positive)')
    check_seed(hparams.run, num_ranks, prefix=prefix + 'run.')
    hyperparams.require(ppo.batch_size % (num_ranks * ppo.nminibatches) == 0, prefix + 'ppo.batch_size', ppo.batch_size,
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
        check_reward(hparams.rewards.train_new_model, num_ranks, prefix=prefix + 'rewards.train_new_model.')


def check_reward_task(hparams, *, prefix=''):
    """The reward model trained here (rewards.train_new_model) learns from samples of the policy's task,
    so its task must be the policy's (the original asserted `hparams.task == ...task` in train, printing
    both reprs): one line naming the first field that differs."""
    if hparams.rewards.train_new_model is None:
        return
    ours = hparams.task.to_flat_dict()
    theirs = hparams.rewards.train_new_model.task.to_flat_dict()
    differ = [k for k in ours if ours[k] != theirs[k]]
    if differ:
        k = differ[0]
        also = f' (also differing: {", ".join(differ[1:])})' if len(differ) > 1 else ''
        raise hyperparams.HParamValueError(
            f"hyperparameter '{prefix}rewards.train_new_model.task.{k}' is {theirs[k]!r} but '{prefix}task.{k}' is "
            f"{ours[k]!r}: the reward model is trained on the policy's task, they must be equal (--task.{k} "
            f"alone sets both){also}")
