#!/usr/bin/env python3
"""Experiments of the paper and the command line to run them (port of the original launch.py).

    python launch.py train_reward sentiment my_run [--dry_run] [--mpi N] [--procs P] [--save_dir DIR] [--lr 1e-4 ...]
    python launch.py train_policy descriptiveness my_run [--rewards.trained_model DIR --rewards.train_new_model off]
    python launch.py train_policy demo my_run    # the offline demo: minutes on a CPU, nothing downloaded
    python launch.py train_policy sentiment_mini my_run    # the sentiment task in miniature, offline too
    python launch.py frontier sentiment_mini    # its reward-KL frontier: PPO offline and online, best-of-n, DPO
"""

import functools
import os
import tempfile

from lm_human_preferences import launch_commands
from lm_human_preferences.demo import bindings as demo_bindings
from lm_human_preferences.sentiment_mini import bindings as sentiment_mini_bindings
from lm_human_preferences.utils import launch
from lm_human_preferences.utils.combos import bind, bind_nested, combos


books_task = combos(
    bind('query_length', 64),
    bind('query_dataset', 'books'),
    bind('response_length', 24),
    bind('start_text', '.'), # Start the context at the beginning of a sentence
    bind('end_text', '.'), # End the context at the end of a sentence.
    bind('truncate_token', 13), # Encoding of '.' -- end completions at the end of a sentence.
    bind('truncate_after', 16), # Make sure completions are at least 16 tokens long.

    bind('policy.temperature', 0.7),
    bind('policy.initial_model', '124M'),
)

summarize_cnndm_task = combos(
    bind('query_prefix', 'Article:\n\n'),
    bind('query_suffix', '\n\nTL;DR:'),
    bind('end_text', '\n'),
    bind('query_dataset', 'cnndm'),
    bind('query_length', 500),
    bind('response_length', 75),
    bind('start_text', None),
    bind('truncate_after', 55),
    bind('truncate_token', 198),  # '\n'

    bind('policy.temperature', 0.5),
    bind('policy.initial_model', '124M'),
)

summarize_tldr_task = combos(
    bind('query_suffix', '\n\nTL;DR:'),
    bind('query_dataset', 'tldr'),
    bind('query_length', 500),
    bind('response_length', 75),
    bind('start_text', None),
    bind('truncate_after', 55),
    bind('truncate_token', 198),  # '\n'

    bind('policy.temperature', 0.7),
    bind('policy.initial_model', '124M'),
)

# Ours, not the original's: the original's tiny `test` model, encoding, dataset and labels, for a run that
# finishes in seconds on a CPU (the original exercised them only from its pytest files).
test_task = combos(
    bind('query_length', 2),
    bind('query_dataset', 'test'),
    bind('response_length', 3),
    bind('policy.initial_model', 'test'),
)

# Ours: the paper's experiments run their 8 ranks side by side in each process (utils/ranks.py), so one pass
# holds 8 ranks' sequences: 'auto' splits the passes to the device's free memory (training/memory.py).
PAPER_MICROBATCH_SIZE = 'auto'


def get_train_reward_experiments():
    _shared = combos(
        bind('labels.type', 'best_of_4'),
        bind('normalize_after', True),
        bind('normalize_before', True),
        bind('normalize_samples', 256),
        bind('run.microbatch_size', PAPER_MICROBATCH_SIZE),
    )


    _books_task = combos(
        bind_nested('task', books_task),
        _shared,
        bind('batch_size', 32),
        bind('lr', 5e-5),
        bind('rollout_batch_size', 512),
    )

    sentiment = combos(
        _books_task,

        bind('labels.source', 'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/sentiment/offline_5k.json'),
        bind('labels.num_train', 4_992),
        bind('run.seed', 1)
    )


    descriptiveness = combos(
        _books_task,

        bind('labels.source', 'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/descriptiveness/offline_5k.json'),
        bind('labels.num_train', 4_992),
        bind('run.seed', 1)
    )

    cnndm = combos(
        bind_nested('task', summarize_cnndm_task),
        _shared,

        # bind('labels.source', 'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/cnndm/offline_60k.json'),
        # bind('labels.num_train', 60_000),
        bind('labels.source', 'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/cnndm/online_45k.json'),
        bind('labels.num_train', 46_000),

        bind('batch_size', 2 * 8),
        bind('lr', 2.5e-5),
        bind('rollout_batch_size', 128),
        bind('run.seed', 1)
    )

    tldr = combos(
        bind_nested('task', summarize_tldr_task),
        _shared,

        # bind('labels.source', 'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/tldr/offline_60k.json'),
        # bind('labels.num_train', 60_000),
        bind('labels.source', 'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/tldr/online_45k.json'),
        bind('labels.num_train', 46_000),

        bind('batch_size', 2 * 8),
        bind('lr', 2.5e-5),
        bind('rollout_batch_size', 128),
        bind('run.seed', 1)
    )

    test = combos(
        bind_nested('task', test_task),
        bind('labels.type', 'best_of_4'),
        bind('labels.source', 'test'),
        bind('labels.num_train', 16),
        bind('batch_size', 8),
        bind('rollout_batch_size', 8),
        bind('normalize_before', True),
        bind('normalize_after', True),
        bind('normalize_samples', 64),
        bind('run.log_interval', 1),
        bind('run.seed', 1),
    )

    # Ours: the offline experiments' bindings live beside them (demo/bindings.py, sentiment_mini/bindings.py).
    demo = demo_bindings.train_reward
    sentiment_mini = sentiment_mini_bindings.train_reward(books_task, _shared)

    return dict(sentiment=sentiment, descriptiveness=descriptiveness, cnndm=cnndm, tldr=tldr, test=test, demo=demo,
                sentiment_mini=sentiment_mini)


def get_experiments():
    train_reward_experiments = get_train_reward_experiments()

    _books_task = combos(
        bind_nested('task', books_task),

        bind('ppo.lr', 1e-5),
        bind('ppo.total_episodes', 1_000_000),
        bind('ppo.batch_size', 512),
        bind('run.microbatch_size', PAPER_MICROBATCH_SIZE),
    )

    sentiment = combos(
        _books_task,
        bind('rewards.kl_coef', 0.15),
        bind('rewards.adaptive_kl', 'on'),
        bind('rewards.adaptive_kl.target', 6.0),

        bind('rewards.train_new_model', 'on'),
        bind_nested('rewards.train_new_model', train_reward_experiments['sentiment']),
        # bind('rewards.trained_model', '/your/directory/here/reward_model/'),

        bind('run.seed', 1)
    )

    descriptiveness = combos(
        _books_task,
        bind('rewards.kl_coef', 0.15),
        bind('rewards.adaptive_kl', 'on'),
        bind('rewards.adaptive_kl.target', 6.0),

        bind('rewards.train_new_model', 'on'),
        bind_nested('rewards.train_new_model', train_reward_experiments['descriptiveness']),
        # bind('rewards.trained_model', '/your/directory/here/reward_model/'),

        bind('run.seed', 1)
    )

    cnndm = combos(
        bind_nested('task', summarize_cnndm_task),
        bind('run.microbatch_size', PAPER_MICROBATCH_SIZE),

        bind('rewards.train_new_model', 'on'),
        bind_nested('rewards.train_new_model', train_reward_experiments['cnndm']),
        # bind('rewards.trained_model', '/your/directory/here/reward_model/'),

        bind('ppo.total_episodes', 1_000_000),
        bind('ppo.lr', 2e-6),
        bind('rewards.kl_coef', 0.01),
        # bind('rewards.adaptive_kl', 'on'),
        # bind('rewards.adaptive_kl.target', 18.0),
        bind('ppo.batch_size', 32),
        # The original bound 'rewards.whiten', a field that does not exist (the run failed in
        # override_from_dict); the whitening switch is ppo.whiten_rewards.
        bind('ppo.whiten_rewards', False),

        bind('run.seed', 1)
    )

    tldr = combos(
        bind_nested('task', summarize_tldr_task),
        bind('run.microbatch_size', PAPER_MICROBATCH_SIZE),

        bind('rewards.train_new_model', 'on'),
        bind_nested('rewards.train_new_model', train_reward_experiments['tldr']),
        # bind('rewards.trained_model', '/your/directory/here/reward_model/'),

        bind('ppo.total_episodes', 1_000_000),
        bind('ppo.lr', 2e-6),
        bind('rewards.kl_coef', 0.03), # 0.01 too low
        # bind('rewards.adaptive_kl', 'on'),
        # bind('rewards.adaptive_kl.target', 18.0),
        bind('ppo.batch_size', 32),
        bind('ppo.whiten_rewards', False),  # the original's 'rewards.whiten' (see cnndm above)

        bind('run.seed', 1)
    )

    test = combos(
        bind_nested('task', test_task),
        bind('rewards.train_new_model', 'on'),
        bind_nested('rewards.train_new_model', train_reward_experiments['test']),
        # 32 episodes a batch: with --mpi 4 each rank still whitens over 8 (the minimum PPOTrainer asserts).
        bind('ppo.batch_size', 32),
        bind('ppo.noptepochs', 1),
        bind('ppo.total_episodes', 64),
        bind('run.log_interval', 1),
        bind('run.seed', 1),
    )

    demo = demo_bindings.train_policy
    sentiment_mini = sentiment_mini_bindings.train_policy(books_task, train_reward_experiments['sentiment_mini'])

    return dict(sentiment=sentiment, descriptiveness=descriptiveness, cnndm=cnndm, tldr=tldr, test=test, demo=demo,
                sentiment_mini=sentiment_mini)


def launch_train_policy(exp, name, dry_run=False, mpi=None, procs=None, save_dir=os.path.join(tempfile.gettempdir(), 'save', 'train_policy'), **extra_hparams):
    """Fine-tune a policy with PPO against a reward model: the experiment's reward model is trained first
    into <save_dir>/NAME/reward_model, unless --rewards.trained_model DIR --rewards.train_new_model off.
    Rerunning the same command resumes from the last saved state. --mpi N: the original's N ranks (its
    8 for the paper's experiments), carried by --procs P processes (default: one per GPU, or 1)."""
    launch_commands.check_name(name)
    trials = launch_commands.get_trials(get_experiments(), 'train_policy', exp)
    from lm_human_preferences import train_policy  # lazily: it pulls in the models and datasets
    from lm_human_preferences.online import loop  # ours: train_policy's online loop, its checks

    launch.launch_trials(
        name, fn=functools.partial(launch_commands.run_command, command='train_policy', exp=exp), trials=trials,
        mpi=launch_commands.default_mpi(exp) if mpi is None else mpi, procs=procs, save_dir=save_dir,
        hparam_class=train_policy.HParams, extra_hparams=extra_hparams, dry_run=dry_run,
        hparams_for_ranks=loop.check_hparams,
        derive=functools.partial(launch_commands.one_seed,
                                 reward_seed_given=launch_commands.REWARD_SEED in extra_hparams))


def launch_train_reward(exp, name, dry_run=False, mpi=None, procs=None, save_dir=os.path.join(tempfile.gettempdir(), 'save', 'train_reward'), **extra_hparams):
    """Train a reward model on the experiment's human labels (one epoch), normalized on samples of the
    initial policy. Rerunning the same command resumes from the last saved state. --mpi N: the
    original's N ranks (its 8 for the paper's experiments), carried by --procs P processes."""
    launch_commands.check_name(name)
    trials = launch_commands.get_trials(get_train_reward_experiments(), 'train_reward', exp)
    from lm_human_preferences import train_reward
    from lm_human_preferences.training import run_checks

    launch.launch_trials(
        name, fn=functools.partial(launch_commands.run_command, command='train_reward', exp=exp), trials=trials,
        mpi=launch_commands.default_mpi(exp) if mpi is None else mpi, procs=procs, save_dir=save_dir,
        hparam_class=train_reward.HParams, extra_hparams=extra_hparams, dry_run=dry_run,
        hparams_for_ranks=run_checks.check_reward)


launch_commands.describe(launch_train_policy, 'train_policy', get_experiments)  # ours: --help
launch_commands.describe(launch_train_reward, 'train_reward', get_train_reward_experiments)

if __name__ == '__main__':
    launch.main(dict(
        train_policy=launch_train_policy,
        train_reward=launch_train_reward,
        label=launch_commands.label_command(get_train_reward_experiments),  # ours: labeling/
        export_labels=launch_commands.launch_export_labels,
        publish=launch_commands.launch_publish,  # ours: offline/published.py
        frontier=launch_commands.frontier_command(launch_train_policy, launch_train_reward, get_experiments),  # ours
    ))
