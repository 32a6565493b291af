#!/usr/bin/env python3
"""Print samples from a trained policy (port of the original sample.py).

    python sample.py sample --save_dir DIR [--savescope policy] [--nsamples N] [--temperature T]
                            [--batch_size B] [--seed S] [--mpi N] [--procs P]

DIR is a train_policy save dir: ours (train_policy_hparams.json + policy/) or an original TF run's
(same layout, TF checkpoints under policy/checkpoints/, converted on first use). Queries come from the
task's test split. nsamples 0 (the default, as the original) samples forever. Ours: the commands
`export`, `plot` and `best_of_n` (lm_human_preferences/sample_commands.py).
"""

import os
from functools import partial

import torch

from lm_human_preferences import lm_tasks, sample_commands, train_policy
from lm_human_preferences.language import trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import command_line, launch, passes, ranks


def sample_policy(save_dir=None, savescope='policy', temperature=1.0, seed=None, batch_size=4, nsamples=0):
    hparams = train_policy.HParams()
    hparams.override_from_json_file(os.path.join(save_dir, 'train_policy_hparams.json'))
    task = hparams.task

    nsamples_per_rank = utils.exact_div(nsamples, ranks.get_world_size())
    # savescope picks the model inside an original TF checkpoint (which held policy, ref_policy and
    # reward_model); the original accepted it but always loaded 'policy'.
    m = trained_models.TrainedModel(name='sample', savedir=os.path.join(save_dir, 'policy'), scope=savescope)
    encoder = m.encoding.get_encoder()

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
        with torch.no_grad(), passes.autocast(hparams.run.use_bf16()):
            rollouts = policy.respond(queries, length=task.response_length)
        return queries, rollouts['responses']

    sample_commands.print_what_is_sampled(m, task, temperature=temperature, seed=seed, batch_size=batch_size,
                                          nsamples=nsamples)
    generated = 0
    while nsamples_per_rank == 0 or generated < nsamples_per_rank:
        # The ranks this process carries, one after another (each prints its own, as the original's ranks).
        for queries, responses in ranks.for_each_rank(rank_batch):
            assert len(queries.tolist()) == batch_size
            assert len(responses.tolist()) == batch_size
            for q, r in zip(queries.tolist(), responses.tolist()):
                print('=' * 80)
                print('query:    ' + encoder.decode(q).replace("\n", "⏎"))
                print('response: ' + encoder.decode(r).replace("\n", "⏎"))
        generated += batch_size


def launch_sample(save_dir=None, savescope='policy', temperature=1.0, seed=None, batch_size=4, nsamples=0, mpi=1,
                  procs=None):
    """Print samples of a trained policy (a train_policy save dir: ours, or an original TF run's) on queries of
    its task's test split; --nsamples 0 samples forever, as the original."""
    # The original defaulted to mpi=8 (MPI ranks); one rank is the sensible default here (sampling has no
    # math that depends on the ranks).
    kwargs = sample_commands.check_sample_options(save_dir, savescope, temperature, seed, batch_size, nsamples,
                                                  mpi, procs)
    launch.launch('sample', partial(sample_policy, **kwargs), mpi=mpi, procs=procs)


# `--help` for the options left unset.
launch_sample.option_help = dict(save_dir=command_line.REQUIRED, seed='random', procs=launch.PROCS_HELP)

# A dict of commands, as the original (launch.main is its fire-like command line).
COMMANDS = dict(
    sample=launch_sample,
    export=sample_commands.launch_export,  # ours: sample_commands.py
    plot=sample_commands.launch_plot,
    best_of_n=sample_commands.launch_best_of_n,
)

if __name__ == '__main__':
    launch.main(COMMANDS)
