"""Ours: sample.py's commands beyond the original's `sample`, on a save dir:

    python sample.py export --save_dir DIR --out HF_DIR [--savescope policy|reward_model] [--force]
    python sample.py plot --save_dir DIR [--out FIGURE.png] [--title TITLE]
    python sample.py best_of_n --save_dir DIR [--n 32] [--queries 256] [--seed 0]

`export` writes DIR's policy (or reward model) as a Hugging Face transformers GPT-2 folder (a new or empty one
outside every save dir; --force replaces an earlier export); `plot` draws its learning curves again (the figures
its run drew), or with --out all of them in one figure; `best_of_n`, for a run of an offline experiment: the
labeler's score of the best of k samples of the initial policy, picked by the run's reward model, by PPO's score
and by the labeler, beside best-of-k's KL. And `sample`'s checks of its options and its first line.
"""

import json
import os

from lm_human_preferences import offline_experiments, train_policy
from lm_human_preferences.language import checkpoints, hf_export
from lm_human_preferences.offline import experiment as offline_experiment
from lm_human_preferences.offline import report as offline_report
from lm_human_preferences.training import plots, run_folders
from lm_human_preferences.utils import command_line, hyperparams, ranks, workers
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils.command_line import ConfigError


def _runs_inside(save_dir):
    """' it holds the runs A, B: --save_dir <save_dir>/A' when save_dir is a folder of train_policy save dirs
    (as launch.py's --save_dir), else ''."""
    if not os.path.isdir(save_dir):
        return ''
    runs = sorted(d for d in os.listdir(save_dir)
                  if os.path.isfile(os.path.join(save_dir, d, 'train_policy_hparams.json')))
    if not runs:
        return ''
    shown = ', '.join(runs[:10]) + (f' and {len(runs) - 10} more' if len(runs) > 10 else '')
    return f'; it holds the runs {shown}: --save_dir {os.path.join(save_dir, runs[0])}'


def _check_save_dir(save_dir, savescope):
    """One-line errors (ConfigError) for a save dir we cannot sample from."""
    if save_dir is None:
        raise ConfigError('sample needs --save_dir DIR (a train_policy save dir)')
    if not os.path.isdir(save_dir):
        raise ConfigError(f'save dir {save_dir} does not exist')
    hparams_path = os.path.join(save_dir, 'train_policy_hparams.json')
    if not os.path.isfile(hparams_path):
        raise ConfigError(f'{hparams_path} does not exist (is {save_dir} a train_policy save dir?)'
                          + _runs_inside(save_dir))
    policy_dir = os.path.join(save_dir, 'policy')
    if not os.path.isdir(policy_dir):
        raise ConfigError(f'{policy_dir} does not exist (no policy was saved in {save_dir})')
    if savescope != 'policy' and checkpoints.latest_checkpoint(policy_dir) is not None:
        raise ConfigError(f'--savescope {savescope}: {policy_dir} is one of our checkpoints, which '
                          f'hold only the policy (other scopes exist only in original TF checkpoints)')


def _parse(name, value, parse):
    # launch.main passes options whose default is None (here --seed) as strings.
    if value is None or not isinstance(value, str):
        return value
    try:
        return parse(value)
    except ValueError:
        raise ConfigError(f'option --{name}: invalid value {value!r}') from None


def check_sample_options(save_dir, savescope, temperature, seed, batch_size, nsamples, mpi, procs):
    """sample's one-line errors (the original sampled 0 or forever, or crashed later); returns sample_policy's
    keyword arguments."""
    _check_save_dir(save_dir, savescope)
    kwargs = dict(save_dir=save_dir, savescope=savescope, temperature=temperature,
                  seed=_parse('seed', seed, int), batch_size=batch_size, nsamples=nsamples)
    if batch_size < 1:
        raise ConfigError(f'--batch_size {batch_size}: it must be at least 1')
    if nsamples < 0:
        raise ConfigError(f'--nsamples {nsamples}: it must be at least 0 (0: sample forever)')
    if not hyperparams.positive(temperature):
        raise ConfigError(f'--temperature {temperature}: it must be a positive number')
    workers.check_mpi_and_procs('sample', mpi, workers.default_procs(mpi) if procs is None else procs)
    if nsamples % mpi:
        raise ConfigError(f'--nsamples {nsamples} must be a multiple of --mpi {mpi}')
    return kwargs


def print_what_is_sampled(m, task, *, temperature, seed, batch_size, nsamples):
    """One line saying what sample_policy samples (the original printed the whole HParams repr and the model's
    hparams)."""
    nsamples_per_rank = utils.exact_div(nsamples, ranks.get_world_size())
    if ranks.is_root():
        total = utils.ceil_div(nsamples_per_rank, batch_size) * batch_size * ranks.get_world_size()
        count = ('samples forever (--nsamples 0)' if nsamples == 0 else f'{total} samples' if total == nsamples else
                 f'{total} samples (--nsamples {nsamples} in whole batches of --batch_size {batch_size})')
        print(f'sample: {count} of {m.checkpoint()} at temperature {temperature:g}, seed '
              f'{"random" if seed is None else seed}, on queries from the test split of {task.query_dataset}')


def launch_export(save_dir=None, out=None, savescope='policy', force=False):
    """Ours: write <save_dir>/<savescope> (the trained policy, or with --savescope reward_model the reward
    model) as a Hugging Face transformers GPT-2 folder at --out, a new or empty folder outside every save
    dir (--force: replace an earlier export there); see language/hf_export.py."""
    if save_dir is None or out is None:
        raise ConfigError('export needs --save_dir DIR (a train_policy / train_reward save dir) and --out HF_DIR')
    if savescope not in ('policy', 'reward_model'):
        raise ConfigError(f"--savescope {savescope}: export takes 'policy' or 'reward_model'")
    model_dir = os.path.join(save_dir, savescope)
    if not os.path.isdir(model_dir):
        raise ConfigError(f'{model_dir} does not exist (no {savescope} was saved in {save_dir})'
                          + _runs_inside(save_dir))
    task = None  # a policy's sampling settings, for the export's generation_config.json
    hparams_path = os.path.join(save_dir, 'train_policy_hparams.json')
    if savescope == 'policy' and os.path.isfile(hparams_path):
        hparams = train_policy.HParams()
        hparams.override_from_json_file(hparams_path)
        task = hparams.task
    held = run_folders.run_folder_of(out)  # never, with --force neither: its files would lie among the run's
    if held is not None:
        where = 'is' if held[0] == os.path.realpath(out) else 'is inside'
        raise ValueError(f'{out} {where} the run folder {held[0]} (it holds {held[1]}): export into a folder of '
                         f'its own, outside the save dir')
    for path in hf_export.export(model_dir, out, scope=savescope, task=task, force=force):
        print(path)
    print('\n'.join(hf_export.usage(out)))


# The offline experiments, for their figures and best_of_n; importing them registers their query datasets, which
# their runs sample from.
OFFLINE_EXPERIMENTS = offline_experiments.experiments()


def launch_plot(save_dir=None, out=None, title=None):
    """Ours: draw again the figures of a train_reward / train_policy save dir: the trainers' *_curves.png
    and, for an offline experiment (demo, sentiment_mini), <name>_curves.png; or with --out every panel in
    one figure (for an offline experiment: its figure)."""
    if save_dir is None:
        raise ConfigError('plot needs --save_dir DIR (a train_reward / train_policy save dir)')
    reported = [exp for exp in OFFLINE_EXPERIMENTS if os.path.isfile(offline_report.report_file(exp, save_dir))]
    if out is None:
        paths = plots.plot_learning_curves(save_dir) + [offline_report.plot_report(exp, save_dir) for exp in reported]
    elif reported:
        paths = [offline_report.plot_report(reported[0], save_dir, out, title=title)]
    else:
        paths = [plots.plot_combined(save_dir, out, title=title)]
    for path in paths:
        print(path)


def launch_best_of_n(save_dir=None, n=32, queries=256, seed=0):
    """Ours: for a train_policy save dir of an offline experiment (demo, sentiment_mini), how much of the
    labeler its reward model holds and its PPO score keeps: the labeler's score of the best of k samples of
    the initial policy, picked by the reward model, by PPO's score (the reward model and the task's
    penalty) and by the labeler, for k = 1, 2, 4, ... n, beside best-of-k's KL bound and the policy's gain
    in the run's report."""
    if save_dir is None or not os.path.isfile(os.path.join(save_dir, 'train_policy_hparams.json')):
        raise ConfigError(f'best_of_n needs --save_dir DIR, a train_policy save dir; {save_dir} has no '
                          f'train_policy_hparams.json' + (_runs_inside(save_dir) if save_dir else ''))
    for name, value in (('n', n), ('queries', queries)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f'best_of_n: --{name} is {value!r}; it must be a whole number at least 1')
    hparams = train_policy.HParams()
    hparams.override_from_json_file(os.path.join(save_dir, 'train_policy_hparams.json'))
    exps = [exp for exp in OFFLINE_EXPERIMENTS if hparams.task.query_dataset == exp.name]
    if not exps:
        raise ConfigError(f"best_of_n is for the offline experiments ({', '.join(e.name for e in OFFLINE_EXPERIMENTS)}), "
                          f"whose labelers it runs; {save_dir} is a run of task.query_dataset "
                          f"'{hparams.task.query_dataset}'")
    exp = exps[0]
    rows, scores = offline_experiment.best_of_n(exp, hparams, n=n, queries=queries, seed=seed)
    unit = float(scores.std(unbiased=False))  # the initial policy's, as the report's unit
    start = float(scores.mean())
    print(f'{exp.labeler.score_name} of the best of k samples of the initial policy, on {queries} test queries; '
          f'(+x): standard deviations of its scores ({unit:.2f}), to a standard error of about {1 / queries ** 0.5:.2f}')
    columns = (('reward_model_pick', 'the reward model'), ('ppo_score_pick', "PPO's score"),
               ('labeler_pick', exp.labeler.title))
    print(f"{'k':>4} {'KL bound':>9}" + ''.join(f'{"picked by " + title:>28}' for _, title in columns))
    for row in rows:
        print(f"{row['k']:>4} {row['kl_bound']:>9.2f}" +
              ''.join(f"{row[key]:>20.3f} ({(row[key] - start) / unit:+.2f})" for key, _ in columns))
    report_path = offline_report.report_file(exp, save_dir)
    if os.path.isfile(report_path):
        with open(report_path) as f:
            report = json.load(f)
        key = exp.labeler.name
        print(f"the run's PPO policy: {report[f'{key}_gain_initial_stds']:+.2f} at objective/kl {report['kl']:.2f} nats"
              if f'{key}_gain_initial_stds' in report else f"the run's PPO policy: objective/kl {report['kl']:.2f} nats")


# `--help` for the options left unset.
launch_export.option_help = dict(save_dir=command_line.REQUIRED, out=command_line.REQUIRED)
launch_best_of_n.option_help = dict(save_dir=command_line.REQUIRED)
launch_plot.option_help = dict(save_dir=command_line.REQUIRED, out="none: the save dir's own figures, drawn again",
                               title='the save dir (an offline experiment: its command)')
