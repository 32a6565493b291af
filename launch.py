#!/usr/bin/env python3
"""Experiments of the paper and the command line to run them (port of the original launch.py).

    python launch.py train_reward sentiment my_run [--dry_run] [--mpi N] [--procs P] [--save_dir DIR] [--labels.num_train 64 ...]
    python launch.py train_policy descriptiveness my_run [--rewards.trained_model DIR --rewards.train_new_model off]
    python launch.py train_policy demo my_run    # the offline demo: minutes on a CPU, nothing downloaded
    python launch.py train_policy sentiment_mini my_run    # the sentiment task in miniature, offline too
"""

import functools
import importlib
import os
import tempfile

from lm_human_preferences.demo import bindings as demo_bindings
from lm_human_preferences.sentiment_mini import bindings as sentiment_mini_bindings
from lm_human_preferences.utils import command_line, launch, workers
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


def _get_trials(experiment_dict, command, exp):
    try:
        return experiment_dict[exp]
    except KeyError:
        raise launch.ConfigError(
            f"Couldn't find experiment '{exp}' for {command} (choose from: {', '.join(experiment_dict)})") from None


def _check_name(name):
    """Ours: NAME is a directory under --save_dir, so it must be one plain name (the run's files stay
    inside --save_dir, in a directory of their own)."""
    if name in ('', '.', '..') or any(c and c in name for c in ('/', os.sep, os.altsep, '\0')):
        raise launch.ConfigError(f"run name {name!r}: it must be a plain directory name "
                                 f"(no '/', not '.' or '..', not empty)")


# The paper's experiments ran as 8 MPI ranks (the original's default mpi=8), and their numbers depend on
# it (per-rank batches, whitening, seeds); ours (test and the offline ones) are sized for one rank.
PAPER_RANKS = 8

# Ours: the offline experiments, each run by its package (it makes its initial model and labels, runs the
# trainer, then reports: offline/experiment.py).
OFFLINE_EXPERIMENTS = dict(demo='lm_human_preferences.demo', sentiment_mini='lm_human_preferences.sentiment_mini')
ONE_RANK_EXPERIMENTS = ('test', *OFFLINE_EXPERIMENTS)


def _default_mpi(exp):
    return 1 if exp in ONE_RANK_EXPERIMENTS else PAPER_RANKS


def _command(exp, trainer, command):
    """The function that runs `command` ('train_policy' / 'train_reward') for exp: the trainer's train,
    or an offline experiment's own command (lazily imported: it pulls in the models and datasets)."""
    if exp in OFFLINE_EXPERIMENTS:
        return getattr(importlib.import_module(OFFLINE_EXPERIMENTS[exp]), command)
    return trainer.train


REWARD_SEED = 'rewards.train_new_model.run.seed'


def _one_seed(hparams, *, reward_seed_given):
    """Ours: when train_policy trains its reward model first, the policy's run.seed seeds that phase too (its
    labels' draws, its training; an offline experiment's initial model follows it), unless the command line
    sets rewards.train_new_model.run.seed itself: one seed draws the whole run. Then train_policy's derive."""
    from lm_human_preferences import train_policy
    if hparams.rewards.train_new_model is not None and not reward_seed_given:
        hparams.rewards.train_new_model.run.seed = hparams.run.seed
    train_policy.chain_reward_model(hparams)


def launch_train_policy(exp, name, dry_run=False, mpi=None, procs=None, save_dir=os.path.join(tempfile.gettempdir(), 'save', 'train_policy'), **extra_hparams):
    """Fine-tune a policy with PPO against a reward model: the experiment's reward model is trained first
    into <save_dir>/NAME/reward_model, unless --rewards.trained_model DIR --rewards.train_new_model off.
    Rerunning the same command resumes from the last saved state. --mpi N: the original's N ranks (its
    8 for the paper's experiments), carried by --procs P processes (default: one per GPU, or 1)."""
    _check_name(name)
    trials = _get_trials(get_experiments(), 'train_policy', exp)
    from lm_human_preferences import train_policy  # lazily: it pulls in the models and datasets

    launch.launch_trials(
        name, fn=_command(exp, train_policy, 'train_policy'), trials=trials, mpi=_default_mpi(exp) if mpi is None else mpi, procs=procs, save_dir=save_dir,
        hparam_class=train_policy.HParams, extra_hparams=extra_hparams, dry_run=dry_run,
        hparams_for_ranks=train_policy.check_ranks,
        derive=functools.partial(_one_seed, reward_seed_given=REWARD_SEED in extra_hparams))


def launch_train_reward(exp, name, dry_run=False, mpi=None, procs=None, save_dir=os.path.join(tempfile.gettempdir(), 'save', 'train_reward'), **extra_hparams):
    """Train a reward model on the experiment's human labels (one epoch), normalized on samples of the
    initial policy. Rerunning the same command resumes from the last saved state. --mpi N: the
    original's N ranks (its 8 for the paper's experiments), carried by --procs P processes."""
    _check_name(name)
    trials = _get_trials(get_train_reward_experiments(), 'train_reward', exp)
    from lm_human_preferences import train_reward

    launch.launch_trials(
        name, fn=_command(exp, train_reward, 'train_reward'), trials=trials, mpi=_default_mpi(exp) if mpi is None else mpi, procs=procs, save_dir=save_dir,
        hparam_class=train_reward.HParams, extra_hparams=extra_hparams, dry_run=dry_run,
        hparams_for_ranks=train_reward.check_ranks)


def launch_label(exp, name, policy=None, validation=None, num=100, labelers=None, host='127.0.0.1', port=8765,
                 overlap=0.05, save_dir=None, **extra_hparams):
    """Ours: people label questions of the experiment's task in a browser. Prints the page's link(s) and serves
    it until --num labels are given; each answer is saved at once into <save_dir>/NAME/labels.json (the
    original's format: train_reward's --labels.source) beside a log of who answered what, when and how fast.
    Questions: the task's initial model's responses; --policy DIR, a train_policy run's; --validation DIR, two of
    each (the paper's validation questions). --labelers a,b: a link with a secret for each (needed with a --host
    other than 127.0.0.1); --overlap: the share of questions asked twice, for agreement. Rerun to go on."""
    _check_name(name)
    from lm_human_preferences import train_reward
    from lm_human_preferences.labeling import command
    offline = importlib.import_module(OFFLINE_EXPERIMENTS[exp]).EXPERIMENT if exp in OFFLINE_EXPERIMENTS else None
    fn = functools.partial(command.label_session, experiment=exp, offline=offline, policy=policy, validation=validation,
                           num=num, labelers=labelers, host=host, port=port, overlap=overlap)
    launch.launch_trials(name, fn=fn, trials=_get_trials(get_train_reward_experiments(), 'label', exp), mpi=1,
                         procs=1, save_dir=save_dir or command.default_save_dir(), hparam_class=train_reward.HParams,
                         extra_hparams=extra_hparams)


def launch_export_labels(session_dir, out=None):
    """Ours: the labels of a label session (the folder `label` wrote) as a Hugging Face datasets folder in TRL's
    preference format (prompt, chosen, rejected: a best-of-4 label is three pairs), for TRL's trainers."""
    if out is None:
        raise launch.ConfigError('export_labels needs --out HF_DIR (a new or empty folder)')
    from lm_human_preferences.labeling import export
    rows = export.export_labels(session_dir, out)
    print(f'export_labels: {rows} preference pairs of {session_dir} in {out} (datasets.load_from_disk reads them)')


launch_label.option_help = dict(policy='the initial model', validation='off', labelers='anyone names themselves',
                                save_dir='<datasets dir>/labels')
launch_export_labels.option_help = dict(out=command_line.REQUIRED)


# `COMMAND --help`: the experiments, and the hparams most often set (`--dry_run` prints all of them).
RUN_HPARAMS = {
    'run.seed': 'random seed (each rank: seed + 100003 * rank)',
    'run.save_interval': 'steps between saved states (a rerun resumes from the last)',
    'run.log_interval': 'steps between stats tables',
    'run.bf16': 'true/false: bf16 autocast for forward passes (default: on with CUDA)',
    'run.microbatch_size': 'at most this many sequences per model pass, to fit memory (same results)',
    'run.cuda_graph': 'true/false: decoding steps replayed as a CUDA graph (default: on with CUDA)',
    'run.keep_checkpoints': 'model checkpoints kept',
    'run.wandb': 'true: also log to Weights & Biases',
}
COMMON_HPARAMS = dict(
    train_policy={
        'rewards.trained_model': 'a trained reward model dir (with --rewards.train_new_model off)',
        'rewards.kl_coef': 'KL penalty coefficient (initial value with rewards.adaptive_kl)',
        'rewards.adaptive_kl.target': 'target KL of the adaptive controller',
        'ppo.total_episodes': 'episodes to train on',
        'ppo.batch_size': 'episodes per PPO batch, over all ranks',
        'ppo.lr': 'learning rate (decayed linearly to 0)',
        'task.policy.initial_model': "'124M' (GPT-2, downloaded), a model dir, a Hugging Face GPT-2 "
                                     "(folder or hub name), 'test'",
        'task.query_dataset': "books, cnndm, tldr, test, or local:<dir of .txt files>",
        **RUN_HPARAMS},
    train_reward={
        'labels.source': 'the label file: an https URL or a local JSON file',
        'labels.num_train': 'labels to train on (the records after them are held out)',
        'batch_size': 'labels per minibatch, over all ranks',
        'lr': 'learning rate (decayed linearly to 0)',
        'normalize_before': 'true/false', 'normalize_after': 'true/false',
        'task.policy.initial_model': "'124M' (GPT-2, downloaded), a model dir, a Hugging Face GPT-2 "
                                     "(folder or hub name), 'test'",
        **RUN_HPARAMS})


def _help_sections(command, experiments):
    def sections():
        lines = ['experiments (--mpi: the ranks they run as by default):']
        for exp, trials in experiments().items():
            kw = {k: v for k, v, _ in trials[0] if k is not None}
            size = (f"ppo.batch_size {kw['ppo.batch_size']}, {kw['ppo.total_episodes']:,} episodes"
                    if 'ppo.batch_size' in kw else f"{kw['labels.num_train']:,} labels, batch_size {kw['batch_size']}")
            lines.append(f"  {exp:16s} --mpi {_default_mpi(exp)}: {kw['task.query_dataset']} queries "
                         f"({kw['task.query_length']}+{kw['task.response_length']} tokens), model "
                         f"{kw['task.policy.initial_model']}, {size}")
        lines += ['', 'most used hparams (--dotted.name value):']
        lines += [f'  --{k:28s} {v}' for k, v in COMMON_HPARAMS[command].items()]
        return '\n'.join(lines)
    return sections


launch_train_policy.help_sections = _help_sections('train_policy', get_experiments)
launch_train_reward.help_sections = _help_sections('train_reward', get_train_reward_experiments)
launch_train_policy.option_help = launch_train_reward.option_help = dict(
    mpi=f"the experiment's: 1 for {', '.join(ONE_RANK_EXPERIMENTS)}, {PAPER_RANKS} for the paper's",
    procs=workers.PROCS_HELP)


if __name__ == '__main__':
    launch.main(dict(
        train_policy=launch_train_policy,
        train_reward=launch_train_reward,
        label=launch_label,
        export_labels=launch_export_labels,
    ))
