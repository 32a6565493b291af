"""Ours: what launch.py's commands add to the original's: the run name's check, the experiments' default ranks,
what each command runs (the offline experiments' engine on theirs, the trainers on the others, the experiment's
question passed down), one seed for a whole run, each command's `--help`, and our commands `label` and
`export_labels` (labeling/) and `frontier` (frontier/). Light to import: a command's --help needs no torch."""

import functools
import os
import tempfile

from lm_human_preferences import offline_experiments
from lm_human_preferences.utils import command_line, launch
from lm_human_preferences.utils.command_line import ConfigError


def get_trials(experiment_dict, command, exp):
    """exp's trials, for a command that runs: every offline experiment declared first, so that their models and
    labelers are known by name to the checks at launch (task.policy.initial_model, online.labeler)."""
    try:
        trials = experiment_dict[exp]
    except KeyError:
        raise ConfigError(
            f"Couldn't find experiment '{exp}' for {command} (choose from: {', '.join(experiment_dict)})") from None
    offline_experiments.experiments()
    return trials


def check_name(name):
    """Ours: NAME is a directory under --save_dir, so it must be one plain name (the run's files stay
    inside --save_dir, in a directory of their own)."""
    if name in ('', '.', '..') or any(c and c in name for c in ('/', os.sep, os.altsep, '\0')):
        raise ConfigError(f"run name {name!r}: it must be a plain directory name "
                          f"(no '/', not '.' or '..', not empty)")


# The paper's experiments ran as 8 MPI ranks (the original's default mpi=8), and their numbers depend on
# it (per-rank batches, whitening, seeds); ours (test and the offline ones) are sized for one rank.
PAPER_RANKS = 8

# Ours: the offline experiments (offline_experiments.py) each run by their package: it makes its initial model and
# labels, runs the trainer, then reports (offline/experiment.py).
ONE_RANK_EXPERIMENTS = ('test', *offline_experiments.NAMES)


def default_mpi(exp):
    return 1 if exp in ONE_RANK_EXPERIMENTS else PAPER_RANKS


def run_command(hparams, *, command, exp):
    """Runs `command` ('train_policy' / 'train_reward') of exp on hparams, in each process of the run: every offline
    experiment declared first (their models and labelers known by name here too), then an offline experiment's engine
    on it, or the trainer (train_policy's with its online loop, which asks people the experiment's question). What
    it imports pulls in the models and datasets."""
    experiments = dict(zip(offline_experiments.NAMES, offline_experiments.experiments()))
    if exp in experiments:
        from lm_human_preferences.offline import experiment as offline_engine
        return getattr(offline_engine, command)(experiments[exp], hparams)
    if command == 'train_policy':
        from lm_human_preferences.online import loop
        return loop.train(hparams, instructions=instructions(exp))
    from lm_human_preferences import train_reward
    return train_reward.train(hparams)


def instructions(exp):
    """What the labeling page asks on exp's task, by label kind: an offline experiment's labeler's rule in words, a
    paper experiment's instructions (labeling/questions.py), else the generic questions."""
    if exp in offline_experiments.NAMES:
        return offline_experiments.experiment(exp).labeler.instruction
    from lm_human_preferences.labeling import questions
    return questions.INSTRUCTIONS.get(exp, questions.GENERIC_INSTRUCTION)


REWARD_SEED = 'rewards.train_new_model.run.seed'


def one_seed(hparams, *, reward_seed_given):
    """Ours: when train_policy trains its reward model first, the policy's run.seed seeds that phase too (its
    labels' draws, its training; an offline experiment's initial model follows it), unless the command line
    sets rewards.train_new_model.run.seed itself: one seed draws the whole run. Then train_policy's derive."""
    from lm_human_preferences import train_policy
    if hparams.rewards.train_new_model is not None and not reward_seed_given:
        hparams.rewards.train_new_model.run.seed = hparams.run.seed
    train_policy.chain_reward_model(hparams)


def label_command(reward_experiments):
    """launch.py's `label` command, on its train_reward experiments (reward_experiments())."""
    def launch_label(exp, name, policy=None, validation=None, num=100, labelers=None, host='127.0.0.1', port=8765,
                     overlap=0.05, origin=None, save_dir=None, **extra_hparams):
        """Ours: people label questions of the experiment's task in a browser. Prints the page's link(s) and serves
        it until --num labels are given; each answer is saved at once into <save_dir>/NAME/labels.json (the
        original's format: train_reward's --labels.source) beside a log of who answered what, when and how fast.
        Questions: the task's initial model's responses; --policy DIR, a train_policy run's; --validation DIR, two of
        each (the paper's validation questions). --labelers a,b: a link with a secret for each (needed with a --host
        other than 127.0.0.1); --overlap: the share of questions asked twice, for agreement; --origin URL: the address
        people open when a reverse proxy with TLS serves the page (docs/labeling.md). Rerun to go on."""
        check_name(name)
        from lm_human_preferences import train_reward
        from lm_human_preferences.labeling import command
        prepare_task = None
        if exp in offline_experiments.NAMES:  # its initial model is pretrained once, as its trainers' runs do
            from lm_human_preferences.offline import experiment as offline_engine
            prepare_task = functools.partial(offline_engine.resolve_initial_model, offline_experiments.experiment(exp))
        fn = functools.partial(command.label_session, instructions=instructions(exp), policy=policy,
                               validation=validation, num=num, labelers=labelers, host=host, port=port,
                               overlap=overlap, origin=origin, prepare_task=prepare_task)
        launch.launch_trials(name, fn=fn, trials=get_trials(reward_experiments(), 'label', exp), mpi=1,
                             procs=1, save_dir=save_dir or command.default_save_dir(), hparam_class=train_reward.HParams,
                             extra_hparams=extra_hparams)

    launch_label.option_help = dict(policy='the initial model', validation='off', labelers='anyone names themselves',
                                    origin='none: no reverse proxy', save_dir='<datasets dir>/labels')
    return launch_label


def launch_export_labels(session_dir, out=None):
    """Ours: the labels of a label session (the folder `label` wrote) as a Hugging Face datasets folder in TRL's
    preference format (prompt, chosen, rejected: a best-of-4 label is three pairs), for TRL's trainers."""
    if out is None:
        raise ConfigError('export_labels needs --out HF_DIR (a new or empty folder)')
    from lm_human_preferences.labeling import export
    rows = export.export_labels(session_dir, out)
    print(f'export_labels: {rows} preference pairs of {session_dir} in {out} (datasets.load_from_disk reads them)')


launch_export_labels.option_help = dict(out=command_line.REQUIRED)


def launch_publish(exp, save_dirs):
    """Ours: an offline experiment's initial model and the labels of its finished runs (save dirs, comma-separated)
    published into its package (offline/published.py), for every CPU to start from."""
    if exp not in offline_experiments.NAMES:
        raise ConfigError(f"publish: {exp!r} is no offline experiment (choose from: {', '.join(offline_experiments.NAMES)})")
    dirs = [d for d in save_dirs.split(',') if d]
    needed = (f'{exp}_labels.json', 'train_reward_hparams.json')
    missing = [d for d in dirs if not all(os.path.isfile(os.path.join(d, name)) for name in needed)]
    if not dirs or missing:
        raise ConfigError(f"publish: {', '.join(missing) or repr(save_dirs)}: a save dir of a finished {exp} run "
                          f"(with its {' and '.join(needed)}) is needed")
    from lm_human_preferences.offline import published
    published.publish(offline_experiments.experiment(exp), dirs)


def frontier_command(train_policy, train_reward, policy_experiments):
    """launch.py's `frontier` command, running launch.py's train_policy and train_reward commands."""
    def launch_frontier(exp, arms='ppo,ppo_nofilter,online,best_of_n,dpo', seeds='1,2,3', points=None, lr=None,
                        labels=None, out=None, kl_budget='6,12', table_only=False, figure=None, doc=None, readme=None,
                        best_of_n_queries=1024, dpo_batch_size=64, dpo_epochs=1, **extra_hparams):
        """Ours: the reward-KL frontier of an offline experiment (lm_human_preferences/frontier/): offline PPO, online
        PPO (3 retrains, the same labels budget), best-of-n and DPO (TRL's DPOTrainer, the `baselines` extra) on each
        seed's initial model and labels, all on PPO's objective (the reward model's score, the task's filter's penalty),
        offline PPO also without the filter (ppo_nofilter) and with 4x the episodes (ppo_4x, not in the default arms),
        each at several KL budgets (--points 'ppo=0.3,0.2;dpo=1,0.4': kl_coefs, n, betas), at each of --lr's rates
        ('ppo=6e-4,1.2e-3;dpo=1e-4,3e-4'; default: each arm's own) and --labels' counts of training labels (1024,4096:
        the first N of the same labels, the same held out; ppo*, best_of_n and dpo), then the table (<out>/frontier.md,
        .jsonl), the plot and
        each arm's gain at each of --kl_budget's KLs (nats; the first in the README). One progress line a run; rerun
        the same command to resume (finished runs are kept, a stopped one resumes). --table_only: the table and plot
        from the finished runs, in seconds.
        --dotted.hparams go to every run (train_policy's names; rewards.train_new_model.* to the reward models)."""
        from lm_human_preferences.frontier import sweep, table
        if exp not in offline_experiments.NAMES:
            raise ConfigError(f"frontier runs an offline experiment, whose labeler scores every arm (choose from: "
                              f"{', '.join(offline_experiments.NAMES)}); got '{exp}'")
        arm_list = sweep.parse_list('arms', arms, str, allowed=sweep.ARMS)
        seed_list = sweep.parse_list('seeds', seeds, int)
        point_lists = sweep.parse_points(points, arm_list)
        rates = sweep.parse_lr(lr, arm_list)
        label_counts = None if labels is None else sweep.parse_list('labels', labels, int)
        if label_counts is not None and min(label_counts) < 1:
            raise ConfigError(f'--labels {labels}: counts of training labels, each at least 1')
        kl_budgets = sweep.parse_list('kl_budget', kl_budget, float)
        if min(kl_budgets) <= 0:
            raise ConfigError(f'--kl_budget {kl_budget}: KLs in nats, each above 0')
        for name, value in (('best_of_n_queries', best_of_n_queries), ('dpo_batch_size', dpo_batch_size),
                            ('dpo_epochs', dpo_epochs)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f'--{name} {value!r}: it must be a whole number at least 1')
        out = out or os.path.join(tempfile.gettempdir(), 'save', 'frontier', exp)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        figure = figure or os.path.join(repo, 'static', f'frontier_{exp}.png')
        doc = doc or (os.path.join(repo, 'docs', 'frontier.md') if exp == 'sentiment_mini' else None)
        readme = readme or (os.path.join(repo, 'README.md') if exp == 'sentiment_mini' else None)
        command = ' '.join(['python launch.py frontier', exp, f'--arms {",".join(arm_list)}',
                            f'--seeds {",".join(map(str, seed_list))}'] + ([f"--points '{points}'"] if points else [])
                           + ([f"--lr '{lr}'"] if lr else []) + ([f'--labels {labels}'] if labels else [])
                           + [f'--{k} {v}' for k, v in extra_hparams.items()])
        bound = {k: v for k, v, _ in get_trials(policy_experiments(), 'frontier', exp)[0] if k is not None}
        num_train = sweep.labels_num_train(exp, extra_hparams, bound)
        if not table_only:
            sweep.Sweep(offline_experiments.experiment(exp), out, arms=arm_list, seeds=seed_list, points=point_lists, train_policy=train_policy,
                        train_reward=train_reward, bound=bound, extra=extra_hparams,
                        best_of_n_queries=best_of_n_queries, lrs=rates, labels=label_counts,
                        dpo_options=dict(batch_size=dpo_batch_size, epochs=dpo_epochs)).run_all()
        table.write(out, arms=arm_list, kl_budgets=kl_budgets, command=command, figure=figure, doc=doc,
                    readme=readme, default_labels=num_train)  # the runs without -labels<N>: on the label axis too

    launch_frontier.option_help = dict(points='every arm its defaults (frontier/sweep.py)',
                                       lr="each arm's own (the experiment's ppo.lr; DPO's 1e-4)",
                                       labels='labels.num_train alone',
                                       out='<tmp>/save/frontier/EXP', figure='static/frontier_EXP.png',
                                       doc='docs/frontier.md for sentiment_mini, none for another',
                                       readme="README.md's summary for sentiment_mini, none for another")
    return launch_frontier


# `COMMAND --help`: the experiments, and the hparams most often set (`--dry_run` prints all of them).
OFFLINE = ', '.join(offline_experiments.NAMES)
INITIAL_MODELS = f"'124M' (GPT-2, downloaded), a model dir, a Hugging Face GPT-2 (folder or hub name), 'test', {OFFLINE}"
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
        'task.policy.initial_model': INITIAL_MODELS,
        'task.query_dataset': f"books, cnndm, tldr, test, {OFFLINE}, or local:<dir of .txt files>",
        'online.retrains': "K: the paper's online loop, the reward model retrained K times as PPO goes (docs/labeling.md)",
        'online.labeler': "who labels each round: 'people' (the labeling page) or a program: rule, vader",
        'online.num_labels': 'new labels over all rounds (default: K * rewards.train_new_model.labels.num_train)',
        **RUN_HPARAMS},
    train_reward={
        'labels.source': 'the label file: an https URL or a local JSON file',
        'labels.num_train': 'labels to train on (the records after them are held out)',
        'batch_size': 'labels per minibatch, over all ranks',
        'lr': 'learning rate (decayed linearly to 0)',
        'normalize_before': 'true/false', 'normalize_after': 'true/false',
        'task.policy.initial_model': INITIAL_MODELS,
        **RUN_HPARAMS})


def help_sections(command, experiments):
    def sections():
        lines = ['experiments (--mpi: the ranks they run as by default):']
        for exp, trials in experiments().items():
            kw = {k: v for k, v, _ in trials[0] if k is not None}
            size = (f"ppo.batch_size {kw['ppo.batch_size']}, {kw['ppo.total_episodes']:,} episodes"
                    if 'ppo.batch_size' in kw else f"{kw['labels.num_train']:,} labels, batch_size {kw['batch_size']}")
            lines.append(f"  {exp:16s} --mpi {default_mpi(exp)}: {kw['task.query_dataset']} queries "
                         f"({kw['task.query_length']}+{kw['task.response_length']} tokens), model "
                         f"{kw['task.policy.initial_model']}, {size}")
        lines += ['', 'most used hparams (--dotted.name value):']
        lines += [f'  --{k:28s} {v}' for k, v in COMMON_HPARAMS[command].items()]
        return '\n'.join(lines)
    return sections


def describe(command, name, experiments):
    """`--help` of launch.py's `name` command (train_policy, train_reward) on experiments(): its experiments, the
    hparams most used, what --mpi and --procs default to."""
    command.help_sections = help_sections(name, experiments)
    command.option_help = dict(
        mpi=f"the experiment's: 1 for {', '.join(ONE_RANK_EXPERIMENTS)}, {PAPER_RANKS} for the paper's",
        procs=launch.PROCS_HELP)
