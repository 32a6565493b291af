#!/usr/bin/env python3
"""Print samples from a trained policy (port of the original sample.py).

    python sample.py sample --save_dir DIR [--savescope policy] [--nsamples N] [--temperature T]
                            [--batch_size B] [--seed S] [--mpi N] [--procs P]

DIR is a train_policy save dir: ours (train_policy_hparams.json + policy/) or an original TF run's
(same layout, TF checkpoints under policy/checkpoints/, converted on first use). Queries come from the
task's test split. nsamples 0 (the default, as the original) samples forever.

    python sample.py export --save_dir DIR --out HF_DIR [--savescope policy|reward_model]
    python sample.py plot --save_dir DIR [--out FIGURE.png] [--title TITLE]

(ours) `export` writes DIR's policy (or reward model) as a Hugging Face transformers GPT-2 folder; `plot`
draws its learning curves.
"""

import os
from functools import partial

import torch

from lm_human_preferences import lm_tasks, train_policy
import lm_human_preferences.demo  # noqa: F401  (ours: registers the offline demo's query dataset, which its runs sample from)
import lm_human_preferences.sentiment_mini  # noqa: F401  (ours: the same for the sentiment miniature)
from lm_human_preferences.language import checkpoints, hf_export, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import hyperparams, launch, plots


def sample_policy(save_dir=None, savescope='policy', temperature=1.0, seed=None, batch_size=4, nsamples=0):
    hparams = train_policy.HParams()
    hparams.override_from_json_file(os.path.join(save_dir, 'train_policy_hparams.json'))
    print('hparams', hparams)
    task = hparams.task

    nsamples_per_rank = utils.exact_div(nsamples, utils.get_world_size())
    # savescope picks the model inside an original TF checkpoint (which held policy, ref_policy and
    # reward_model); the original accepted it but always loaded 'policy'.
    m = trained_models.TrainedModel(name='sample', savedir=os.path.join(save_dir, 'policy'), scope=savescope)
    encoder = m.encoding.get_encoder()
    hyperparams.dump(m.hparams(), name='model_hparams')

    utils.set_mpi_seed(seed)

    policy = Policy(
        m, scope='policy',
        embed_queries=lm_tasks.query_formatter(task, encoder),
        temperature=temperature,
    ).to(utils.get_device())

    query_sampler = lm_tasks.make_query_sampler(
        hparams=task, encoder=encoder, batch_size=batch_size, mode='test'
    )

    def rank_batch():  # in each rank's section: its queries, its random streams
        queries = query_sampler()['tokens']
        with torch.no_grad(), utils.autocast(hparams.run.use_bf16()):
            rollouts = policy.respond(queries, length=task.response_length)
        return queries, rollouts['responses']

    generated = 0
    while nsamples_per_rank == 0 or generated < nsamples_per_rank:
        # The ranks this process carries, one after another (each prints its own, as the original's ranks).
        for queries, responses in utils.for_each_rank(rank_batch):
            assert len(queries.tolist()) == batch_size
            assert len(responses.tolist()) == batch_size
            for q, r in zip(queries.tolist(), responses.tolist()):
                print('=' * 80)
                print(encoder.decode(q).replace("\n", "⏎"))
                print(encoder.decode(r).replace("\n", "⏎"))
        generated += batch_size


def _check_save_dir(save_dir, savescope):
    """One-line errors (launch.ConfigError) for a save dir we cannot sample from."""
    if save_dir is None:
        raise launch.ConfigError('sample needs --save_dir DIR (a train_policy save dir)')
    if not os.path.isdir(save_dir):
        raise launch.ConfigError(f'save dir {save_dir} does not exist')
    hparams_path = os.path.join(save_dir, 'train_policy_hparams.json')
    if not os.path.isfile(hparams_path):
        raise launch.ConfigError(f'{hparams_path} does not exist (is {save_dir} a train_policy save dir?)')
    policy_dir = os.path.join(save_dir, 'policy')
    if not os.path.isdir(policy_dir):
        raise launch.ConfigError(f'{policy_dir} does not exist (no policy was saved in {save_dir})')
    if savescope != 'policy' and checkpoints.latest_checkpoint(policy_dir) is not None:
        raise launch.ConfigError(f'--savescope {savescope}: {policy_dir} is one of our checkpoints, which '
                                 f'hold only the policy (other scopes exist only in original TF checkpoints)')


def _parse(name, value, parse):
    # launch.main passes options whose default is None (here --seed) as strings.
    if value is None or not isinstance(value, str):
        return value
    try:
        return parse(value)
    except ValueError:
        raise launch.ConfigError(f'option --{name}: invalid value {value!r}') from None


def launch_sample(save_dir=None, savescope='policy', temperature=1.0, seed=None, batch_size=4, nsamples=0, mpi=1,
                  procs=None):
    """Print samples of a trained policy (a train_policy save dir: ours, or an original TF run's) on queries of
    its task's test split; --nsamples 0 samples forever, as the original."""
    # The original defaulted to mpi=8 (MPI ranks); one rank is the sensible default here (sampling has no
    # math that depends on the ranks).
    _check_save_dir(save_dir, savescope)
    kwargs = dict(save_dir=save_dir, savescope=savescope, temperature=temperature,
                  seed=_parse('seed', seed, int), batch_size=batch_size, nsamples=nsamples)
    # Ours: one line for options that cannot work (the original sampled 0 or forever, or crashed later).
    if batch_size < 1:
        raise launch.ConfigError(f'--batch_size {batch_size}: it must be at least 1')
    if nsamples < 0:
        raise launch.ConfigError(f'--nsamples {nsamples}: it must be at least 0 (0: sample forever)')
    if not hyperparams.positive(temperature):
        raise launch.ConfigError(f'--temperature {temperature}: it must be a positive number')
    launch.check_ranks('sample', mpi, launch.default_procs(mpi) if procs is None else procs)
    if nsamples % mpi:
        raise launch.ConfigError(f'--nsamples {nsamples} must be a multiple of --mpi {mpi}')
    launch.launch('sample', partial(sample_policy, **kwargs), mpi=mpi, procs=procs)


def launch_export(save_dir=None, out=None, savescope='policy'):
    """Ours: write <save_dir>/<savescope> (the trained policy, or with --savescope reward_model the reward
    model) as a Hugging Face transformers GPT-2 folder at --out; see language/hf_export.py."""
    if save_dir is None or out is None:
        raise launch.ConfigError('export needs --save_dir DIR (a train_policy / train_reward save dir) and --out HF_DIR')
    if savescope not in ('policy', 'reward_model'):
        raise launch.ConfigError(f"--savescope {savescope}: export takes 'policy' or 'reward_model'")
    model_dir = os.path.join(save_dir, savescope)
    if not os.path.isdir(model_dir):
        raise launch.ConfigError(f'{model_dir} does not exist (no {savescope} was saved in {save_dir})')
    for path in hf_export.export(model_dir, out, scope=savescope):
        print(path)


def launch_plot(save_dir=None, out=None, title=None):
    """Ours: draw the learning curves of a train_reward / train_policy save dir: its *_curves.png again
    (the trainers draw them at the end), or with --out every panel in one figure."""
    if save_dir is None:
        raise launch.ConfigError('plot needs --save_dir DIR (a train_reward / train_policy save dir)')
    paths = [plots.plot_combined(save_dir, out, title=title)] if out else plots.plot_learning_curves(save_dir)
    for path in paths:
        print(path)


# A dict of commands, as the original (launch.main is its fire-like command line).
COMMANDS = dict(
    sample=launch_sample,
    export=launch_export,
    plot=launch_plot,
)

if __name__ == '__main__':
    launch.main(COMMANDS)
