#!/usr/bin/env python3
"""What fits where: the peak memory of one rank's work at the paper's per-rank sizes, by microbatch size.

On one GPU a process carries all 8 of the paper's ranks one after another (launch.py's default), so its
peak is one rank's: the models it holds plus the largest of its passes. This measures that peak for each
phase of a run, in fp32 and bf16, with no split and with `run.microbatch_size` K, using the real trainer
code on GPT-2 124M-shaped models with random weights:

    rollout      PPOTrainer.rollout: sampling (KV cache), [bf16: the old logprobs again], the reference
                 logprobs, the reward model's scores; policy, reference and reward model resident
    ppo_step     PPOTrainer.train_minibatch on one rank's minibatch, twice (the second step holds Adam's
                 moments while it runs the backward pass)
    reward_step  RewardModelTrainer.train_batch on one rank's labels (best_of_4), twice; reward model and
                 the reference policy (for normalization) resident
    normalize    RewardModelTrainer.sample_policy_responses + stats: one rank's normalization samples

Shapes and per-rank sizes come from launch.py's experiments divided by their 8 ranks: sentiment /
descriptiveness (query 64, response 24) and tldr / cnndm (query 500, response 75; their few prefix and
suffix tokens are not counted). Each figure comes from a fresh process: on CUDA torch.cuda.max_memory_
allocated (the caching allocator and the CUDA context add some hundreds of MB on top), on a CPU the peak
RSS (VmHWM) minus the RSS before the models were built (freed tensors go back to the OS at once:
MALLOC_MMAP_THRESHOLD_=1MiB).

    python benchmarks/memory.py                    # everything (about 30 minutes on 2 CPU cores)
    python benchmarks/memory.py --shapes books --phases ppo_step --dtypes fp32
    python benchmarks/memory.py --preset tiny      # smoke run
    python benchmarks/memory.py --table fp32.json bf16.json   # the table of earlier runs (--json)
"""
import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import GPT2_124M, REPO_ROOT, device, machine_info, proc_status_mb, random_trained_model, reset_peak_rss

PHASES = ('rollout', 'ppo_step', 'reward_step', 'normalize')
PRESETS = {
    'gpt2': GPT2_124M,
    'tiny': dict(n_vocab=512, n_ctx=1024, n_embd=64, n_head=2, n_layer=2),
}


@dataclasses.dataclass
class Shape:
    """One rank's share of a paper experiment (launch.py's, divided by its ranks)."""
    name: str
    experiments: str
    query_length: int
    response_length: int
    rollout: int  # PPO episodes per rank and batch
    minibatch: int  # PPO episodes per rank and minibatch
    labels: int  # reward-model labels per rank and minibatch
    normalize: int  # normalization samples per rank and batch (rollout_batch_size / ranks)


def paper_shapes():
    sys.path.insert(0, str(REPO_ROOT))
    import launch as top_launch
    from lm_human_preferences import train_policy

    def hparams(exp):
        trial = top_launch.get_experiments()[exp][0]
        h = train_policy.HParams()
        h.override_from_dict({k: v for k, v, _ in trial if k is not None})
        return h
    ranks = top_launch.PAPER_RANKS
    shapes = {}
    for name, exp, experiments in (('books', 'sentiment', 'sentiment, descriptiveness'), ('tldr', 'tldr', 'tldr, cnndm')):
        h = hparams(exp)
        r = h.rewards.train_new_model
        shapes[name] = Shape(
            name=name, experiments=experiments, query_length=h.task.query_length,
            response_length=h.task.response_length, rollout=h.ppo.batch_size // ranks,
            minibatch=h.ppo.batch_size // ranks // h.ppo.nminibatches, labels=r.batch_size // ranks,
            normalize=r.rollout_batch_size // ranks)
    return shapes


def phase_sequences(shape, phase):
    """The most sequences one pass of the phase holds without a split."""
    return dict(rollout=shape.rollout, ppo_step=shape.minibatch, reward_step=4 * shape.labels,
                normalize=shape.normalize)[phase]


def microbatch_sizes(shape, phase):
    """No split, then a half, a quarter and an eighth of the phase's sequences per pass (at least 1; at
    least 4 for the reward loss, which scores a best_of_4 label's 4 samples in one pass)."""
    n = phase_sequences(shape, phase)
    least = 4 if phase == 'reward_step' else 1
    return [None] + sorted({n // d for d in (2, 4, 8) if n // d >= least}, reverse=True)


# ----------------------------------------------------------------------------------------------
# One measurement, in its own process

def _ppo_trainer(m, shape, bf16, microbatch_size):
    from lm_human_preferences import train_policy
    from lm_human_preferences.policy import Policy
    from lm_human_preferences.rewards import RewardModelTrainer
    tm = random_trained_model(m)
    dev = device()
    policy = Policy(tm, scope='policy').to(dev)
    ref_policy = Policy(tm, scope='ref_policy').to(dev).requires_grad_(False)
    reward_model = RewardModelTrainer(tm).to(dev).requires_grad_(False)
    hp = train_policy.HParams()
    hp.override_from_dict({
        'task.query_length': shape.query_length, 'task.response_length': shape.response_length,
        'rewards.trained_model': 'random', 'ppo.batch_size': shape.rollout,
        'ppo.nminibatches': shape.rollout // shape.minibatch, 'ppo.total_episodes': 10 ** 9,
        'run.log_interval': 10 ** 9, 'run.bf16': bf16, 'run.microbatch_size': microbatch_size})

    class ScoreModel:  # what make_score_fn needs of a TrainedRewardModel
        padding_token = reward_model.padding_token
        score_fn = staticmethod(reward_model.get_rewards)
    g = torch.Generator().manual_seed(0)
    return train_policy.PPOTrainer(
        policy=policy, ref_policy=ref_policy, score_fn=train_policy.make_score_fn(
            hp.task, score_model=ScoreModel(), microbatch_size=microbatch_size), hparams=hp,
        query_sampler=lambda: dict(tokens=torch.randint(0, m['n_vocab'], (shape.rollout, shape.query_length),
                                                        generator=g)))


def _reward_trainer(m, shape, bf16, microbatch_size):
    from lm_human_preferences import train_reward
    from lm_human_preferences.policy import Policy
    from lm_human_preferences.rewards import RewardModelTrainer
    tm = random_trained_model(m)
    dev = device()
    ref_policy = Policy(tm, scope='ref_policy').to(dev).requires_grad_(False)
    hp = train_reward.HParams()
    hp.override_from_dict({
        'task.query_length': shape.query_length, 'task.response_length': shape.response_length,
        'labels.type': 'best_of_4', 'labels.num_train': shape.labels, 'batch_size': shape.labels,
        'rollout_batch_size': shape.normalize, 'run.log_interval': 10 ** 9, 'run.bf16': bf16,
        'run.microbatch_size': microbatch_size})
    g = torch.Generator().manual_seed(0)
    trainer = train_reward.RewardModelTrainer(
        reward_model=RewardModelTrainer(tm).to(dev), policy=ref_policy, hparams=hp,
        query_sampler=lambda: dict(tokens=torch.randint(0, m['n_vocab'], (shape.normalize, shape.query_length),
                                                        generator=g).to(dev)))
    n = shape.labels
    trainer.add_to_buffer(dict(
        query=torch.randint(0, m['n_vocab'], (n, shape.query_length), generator=g, dtype=torch.int32),
        best=torch.randint(0, 4, (n,), generator=g, dtype=torch.int32),
        **{f'sample{i}': torch.randint(0, m['n_vocab'], (n, shape.response_length), generator=g, dtype=torch.int32)
           for i in range(4)}))
    return trainer


def run_phase(trainer, shape, phase, m):
    if phase == 'rollout':
        trainer.rollout(kl_coef=0.15)
    elif phase == 'ppo_step':
        g = torch.Generator().manual_seed(1)
        b, r = shape.minibatch, shape.response_length
        minibatch = {k: v.to(device()) for k, v in dict(
            queries=torch.randint(0, m['n_vocab'], (b, shape.query_length), generator=g),
            responses=torch.randint(0, m['n_vocab'], (b, r), generator=g),
            values=torch.randn(b, r, generator=g), logprobs=-11 + torch.randn(b, r, generator=g),
            rewards=0.1 * torch.randn(b, r, generator=g)).items()}
        for _ in range(2):
            trainer.train_minibatch([minibatch])
    elif phase == 'reward_step':
        for _ in range(2):
            trainer.train_batch([torch.arange(shape.labels)], lr=1e-5)
    else:
        trainer.stats(trainer.sample_policy_responses(shape.normalize))


def probe(spec):
    """In a fresh process: build the phase's models, run it, print the peak memory (MiB) in total and of
    the models alone."""
    m, shape, phase = spec['model'], Shape(**spec['shape']), spec['phase']
    torch.set_num_threads(spec['threads'])
    cuda = device().type == 'cuda'
    gc.collect()
    base = 0 if cuda else proc_status_mb('VmRSS')
    make = _ppo_trainer if phase in ('rollout', 'ppo_step') else _reward_trainer
    trainer = make(m, shape, spec['dtype'] == 'bf16', spec['microbatch_size'])
    gc.collect()
    models = torch.cuda.memory_allocated() / 2 ** 20 if cuda else proc_status_mb('VmRSS') - base
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    started = time.perf_counter()
    with open(os.devnull, 'w') as quiet, _stdout_to(quiet):  # the trainers print their stats tables
        run_phase(trainer, shape, phase, m)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else proc_status_mb('VmHWM') - base
    print('MEMORY ' + json.dumps(dict(peak_mb=peak, models_mb=models, seconds=seconds)))


class _stdout_to:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        self.saved, sys.stdout = sys.stdout, self.f

    def __exit__(self, *exc):
        sys.stdout = self.saved


# ----------------------------------------------------------------------------------------------

def measure(m, shape, phase, dtype, microbatch_size, threads):
    spec = dict(model=m, shape=dataclasses.asdict(shape), phase=phase, dtype=dtype,
                microbatch_size=microbatch_size, threads=threads)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    proc = subprocess.run([sys.executable, __file__, '--_probe', json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('MEMORY ')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f'probe {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}')
    return json.loads(lines[-1][len('MEMORY '):])


def gb(mb):
    return f'{mb / 1024:.2f}'


def markdown(results, shapes, dtypes):
    head = ' | '.join(f'{d} peak GB' for d in dtypes)
    out = [f'| experiments (per rank) | phase | sequences per pass | {head} | models GB |',
           '|---|---|---:|' + '---:|' * len(dtypes) + '---:|']
    for (shape_name, phase), by_k in results.items():
        shape = shapes[shape_name]
        n = phase_sequences(shape, phase)
        for k, by_dtype in by_k.items():
            cells = ' | '.join(gb(by_dtype[d]['peak_mb']) if d in by_dtype else '-' for d in dtypes)
            models = next(iter(by_dtype.values()))['models_mb']
            what = f'{n} (no split)' if k is None else f'{k} (microbatch_size {k})'
            out.append(f'| {shape.experiments} (q{shape.query_length}+r{shape.response_length}) | {phase} | '
                       f'{what} | {cells} | {gb(models)} |')
    return '\n'.join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--preset', choices=sorted(PRESETS), default='gpt2')
    p.add_argument('--shapes', nargs='+', choices=('books', 'tldr'), default=['books', 'tldr'])
    p.add_argument('--phases', nargs='+', choices=PHASES, default=list(PHASES))
    p.add_argument('--dtypes', nargs='+', choices=('fp32', 'bf16'), default=['fp32', 'bf16'])
    p.add_argument('--bf16-sizes', choices=('all', 'ends'), default='all',
                   help='bf16 at every microbatch size, or only at no split and the smallest (a CPU without '
                        'native bf16 runs it several times slower than fp32)')
    p.add_argument('--skip', type=str, help='a JSON of an earlier run: its measurements are taken from it')
    p.add_argument('--table', nargs='+', metavar='JSON',
                   help='print the table of earlier runs\' JSONs (e.g. an fp32 and a bf16 run), measuring nothing')
    p.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument('--json', help='write every measurement here (after each one too)')
    p.add_argument('--_probe', dest='probe', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        probe(json.loads(args.probe))
        return
    m = PRESETS[args.preset]
    shapes = paper_shapes()
    if args.table:
        runs = {path: json.loads(Path(path).read_text()) for path in args.table}
        if len({json.dumps(run['model'], sort_keys=True) for run in runs.values()}) > 1:
            p.error(f'--table: the runs measured different models: {", ".join(runs)}')
        measured = {(r['shape'], r['phase'], r['microbatch_size'], r['dtype']): r
                    for run in runs.values() for r in run['rows']}
        results = {}
        for shape_name in args.shapes:
            for phase in args.phases:
                for k in microbatch_sizes(shapes[shape_name], phase):
                    for dtype in args.dtypes:
                        if (shape_name, phase, k, dtype) in measured:
                            results.setdefault((shape_name, phase), {}).setdefault(k, {})[dtype] = \
                                measured[shape_name, phase, k, dtype]
        print(markdown(results, shapes, args.dtypes))
        return
    info = machine_info()
    print(f'machine: {info["cpu"]}, {info["cores"]} cores, torch {info["torch"]}'
          + (f', {info["cuda"]}' if info['cuda'] else ' (CPU: peak RSS as the proxy)'), flush=True)
    print(f'model: {m}', flush=True)
    started = time.time()
    results, rows = {}, []
    earlier = {}
    if args.skip:
        for row in json.loads(Path(args.skip).read_text())['rows']:
            earlier[(row['shape'], row['phase'], row['microbatch_size'], row['dtype'])] = {
                k: row[k] for k in ('peak_mb', 'models_mb', 'seconds')}
    for shape_name in args.shapes:
        shape = shapes[shape_name]
        print(f'\n== {shape} ==', flush=True)
        for phase in args.phases:
            sizes = microbatch_sizes(shape, phase)
            for k in sizes:
                for dtype in args.dtypes:
                    if dtype == 'bf16' and args.bf16_sizes == 'ends' and k not in (sizes[0], sizes[-1]):
                        continue
                    r = earlier.get((shape_name, phase, k, dtype)) or measure(m, shape, phase, dtype, k, args.threads)
                    results.setdefault((shape_name, phase), {}).setdefault(k, {})[dtype] = r
                    rows.append(dict(shape=shape_name, phase=phase, microbatch_size=k, dtype=dtype, **r))
                    print(f'{shape_name:5s} {phase:11s} K={str(k):4s} {dtype}: peak {gb(r["peak_mb"])} GB '
                          f'(models {gb(r["models_mb"])} GB), {r["seconds"]:.1f} s', flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(dict(machine=info, model=m, rows=rows,
                                                                   shapes={k: dataclasses.asdict(v) for k, v in shapes.items()}), indent=1))
    print('\n' + markdown(results, shapes, args.dtypes))
    print(f'\ntotal wall time {time.time() - started:.0f} s')


if __name__ == '__main__':
    main()
