#!/usr/bin/env python3
"""What fits where: the peak memory of a run's phases by the number of sequences a model pass holds.

A process carries its ranks side by side (utils/ranks.py), so one pass of a phase holds all its ranks'
sequences: on one GPU the paper's 8 ranks, 8 x a rank's share, or `run.microbatch_size` K of them if that is
fewer (each microbatch is done before the next starts, so a phase's peak is that of one pass of K). This
measures the peak of one pass of P sequences for each phase, with the real trainer code on GPT-2
124M-shaped models with random weights, from small P to large, each figure from a fresh process:

    rollout      PPOTrainer.rollout: sampling (its KV cache), [bf16: the old logprobs again], the reference
                 logprobs, the reward model's scores; policy, reference and reward model resident
    ppo_step     PPOTrainer.train_minibatch, twice (the second step holds Adam's moments while it runs the
                 backward pass)
    reward_step  RewardModelTrainer.train_batch on P / 4 best_of_4 labels (its graph holds their 4 samples'
                 passes: P sequences), twice; reward model and the reference policy (for normalization)
                 resident
    normalize    RewardModelTrainer.sample_policy_responses + stats on P normalization samples

Shapes come from launch.py's experiments: sentiment / descriptiveness (query 64, response 24) and tldr /
cnndm (query 500, response 75; their few prefix and suffix tokens are not counted). Each phase's peak grows
linearly with P: the script fits fixed + per-sequence x P to the two largest passes it measured, predicts
the passes that would not fit this machine (--max-gb; marked), and prints for 24, 40 and 80 GB the largest
pass that fits each phase (1 GB is kept for the CUDA context and the allocator's slack). On CUDA the figures
are torch.cuda.max_memory_allocated; on a CPU the peak RSS (VmHWM) minus the RSS before the models were
built (freed tensors go back to the OS at once: MALLOC_MMAP_THRESHOLD_=1MiB), a proxy.

    python benchmarks/memory.py --json fp32.json                      # fp32, both shapes, every phase
    python benchmarks/memory.py --dtypes bf16 --json bf16.json
    python benchmarks/memory.py --shapes books --phases ppo_step
    python benchmarks/memory.py --preset tiny                         # smoke run
    python benchmarks/memory.py --table fp32.json bf16.json           # the table of earlier runs (--json)
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
GPU_GB = (24, 40, 80)
CUDA_OVERHEAD_GB = 1.0  # the CUDA context and the caching allocator's slack, on top of what is allocated


@dataclasses.dataclass
class Shape:
    """A paper experiment's sizes (launch.py's), over all its ranks."""
    name: str
    experiments: str
    query_length: int
    response_length: int
    ranks: int
    rollout: int  # PPO episodes per batch
    minibatch: int  # PPO episodes per minibatch
    labels: int  # reward-model labels per minibatch
    normalize: int  # normalization samples per batch (rollout_batch_size)


def paper_shapes():
    sys.path.insert(0, str(REPO_ROOT))
    import launch as top_launch
    from lm_human_preferences import launch_commands
    from lm_human_preferences import train_policy

    def hparams(exp):
        trial = top_launch.get_experiments()[exp][0]
        h = train_policy.HParams()
        h.override_from_dict({k: v for k, v, _ in trial if k is not None})
        return h
    shapes = {}
    for name, exp, experiments in (('books', 'sentiment', 'sentiment, descriptiveness'), ('tldr', 'tldr', 'tldr, cnndm')):
        h = hparams(exp)
        r = h.rewards.train_new_model
        shapes[name] = Shape(
            name=name, experiments=experiments, query_length=h.task.query_length,
            response_length=h.task.response_length, ranks=launch_commands.PAPER_RANKS, rollout=h.ppo.batch_size,
            minibatch=h.ppo.batch_size // h.ppo.nminibatches, labels=r.batch_size, normalize=r.rollout_batch_size)
    return shapes


def phase_sequences(shape, phase):
    """The sequences one pass of the phase holds without a split, all ranks side by side in one process."""
    return dict(rollout=shape.rollout, ppo_step=shape.minibatch, reward_step=4 * shape.labels,
                normalize=shape.normalize)[phase]


def pass_sizes(shape, phase):
    """The passes measured: the phase's whole one (no split), then halves down to 1/32 (at least 1; at least
    4 for the reward step, which scores a best_of_4 label's 4 samples in one graph), smallest first."""
    n = phase_sequences(shape, phase)
    least = 4 if phase == 'reward_step' else 1
    return sorted({n // d for d in (1, 2, 4, 8, 16, 32) if n // d >= least})


# ----------------------------------------------------------------------------------------------
# One measurement, in its own process

def _ppo_trainer(m, shape, bf16, sequences):
    from lm_human_preferences import train_policy
    from lm_human_preferences.policy import Policy
    from lm_human_preferences.rewards import RewardModelTrainer
    from lm_human_preferences.training.run import Run
    tm = random_trained_model(m)
    dev = device()
    policy = Policy(tm, scope='policy').to(dev)
    ref_policy = Policy(tm, scope='ref_policy').to(dev).requires_grad_(False)
    reward_model = RewardModelTrainer(tm).to(dev).requires_grad_(False)
    hp = train_policy.HParams()
    hp.override_from_dict({
        'task.query_length': shape.query_length, 'task.response_length': shape.response_length,
        'rewards.trained_model': 'random', 'ppo.batch_size': sequences, 'ppo.nminibatches': 1,
        'ppo.total_episodes': 10 ** 9, 'run.log_interval': 10 ** 9, 'run.bf16': bf16})

    class ScoreModel:  # what make_score_fn needs of a TrainedRewardModel
        padding_token = reward_model.padding_token
        score_fn = staticmethod(reward_model.get_rewards)
    g = torch.Generator().manual_seed(0)
    return train_policy.PPOTrainer(
        policy=policy, ref_policy=ref_policy, score_fn=train_policy.make_score_fn(hp.task, score_model=ScoreModel()),
        hparams=hp, run=Run(hp, 'train_policy'),
        query_sampler=lambda: dict(tokens=torch.randint(0, m['n_vocab'], (sequences, shape.query_length), generator=g)))


def _reward_trainer(m, shape, bf16, sequences):
    from lm_human_preferences import train_reward
    from lm_human_preferences.policy import Policy
    from lm_human_preferences.rewards import RewardModelTrainer
    from lm_human_preferences.training.run import Run
    tm = random_trained_model(m)
    dev = device()
    ref_policy = Policy(tm, scope='ref_policy').to(dev).requires_grad_(False)
    labels = max(sequences // 4, 1)
    hp = train_reward.HParams()
    hp.override_from_dict({
        'task.query_length': shape.query_length, 'task.response_length': shape.response_length,
        'labels.type': 'best_of_4', 'labels.num_train': labels, 'batch_size': labels,
        'rollout_batch_size': sequences, 'run.log_interval': 10 ** 9, 'run.bf16': bf16})
    g = torch.Generator().manual_seed(0)
    trainer = train_reward.RewardModelTrainer(
        reward_model=RewardModelTrainer(tm).to(dev), policy=ref_policy, hparams=hp, run=Run(hp, 'train_reward'),
        query_sampler=lambda: dict(tokens=torch.randint(0, m['n_vocab'], (sequences, shape.query_length),
                                                        generator=g).to(dev)))
    trainer.add_to_buffer(dict(
        query=torch.randint(0, m['n_vocab'], (labels, shape.query_length), generator=g, dtype=torch.int32),
        best=torch.randint(0, 4, (labels,), generator=g, dtype=torch.int32),
        **{f'sample{i}': torch.randint(0, m['n_vocab'], (labels, shape.response_length), generator=g, dtype=torch.int32)
           for i in range(4)}))
    return trainer


def run_phase(trainer, shape, phase, m, sequences):
    if phase == 'rollout':
        trainer.rollout(kl_coef=0.15)
    elif phase == 'ppo_step':
        g = torch.Generator().manual_seed(1)
        b, r = sequences, shape.response_length
        minibatch = {k: v.to(device()) for k, v in dict(
            queries=torch.randint(0, m['n_vocab'], (b, shape.query_length), generator=g),
            responses=torch.randint(0, m['n_vocab'], (b, r), generator=g),
            values=torch.randn(b, r, generator=g), logprobs=-11 + torch.randn(b, r, generator=g),
            rewards=0.1 * torch.randn(b, r, generator=g)).items()}
        for _ in range(2):
            trainer.train_minibatch(minibatch)
    elif phase == 'reward_step':
        for _ in range(2):
            trainer.train_batch([torch.arange(max(sequences // 4, 1))], lr=1e-5)
    else:
        trainer.stats(trainer.sample_policy_responses(sequences))


def probe(spec):
    """In a fresh process: build the phase's models, run one pass of the given size, print the peak memory
    (MiB) in total and of the models alone."""
    m, shape, phase = spec['model'], Shape(**spec['shape']), spec['phase']
    torch.set_num_threads(spec['threads'])
    cuda = device().type == 'cuda'
    gc.collect()
    base = 0 if cuda else proc_status_mb('VmRSS')
    make = _ppo_trainer if phase in ('rollout', 'ppo_step') else _reward_trainer
    with open(os.devnull, 'w') as quiet, _stdout_to(quiet):  # the trainers print their run summaries
        trainer = make(m, shape, spec['dtype'] == 'bf16', spec['sequences'])
    gc.collect()
    models = torch.cuda.memory_allocated() / 2 ** 20 if cuda else proc_status_mb('VmRSS') - base
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    started = time.perf_counter()
    with open(os.devnull, 'w') as quiet, _stdout_to(quiet):  # and their stats tables
        run_phase(trainer, shape, phase, m, spec['sequences'])
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


def measure(m, shape, phase, dtype, sequences, threads):
    spec = dict(model=m, shape=dataclasses.asdict(shape), phase=phase, dtype=dtype, sequences=sequences,
                threads=threads)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    proc = subprocess.run([sys.executable, __file__, '--_probe', json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('MEMORY ')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f'probe {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}')
    return json.loads(lines[-1][len('MEMORY '):])


# ----------------------------------------------------------------------------------------------
# The linear model and the tables

def fit(rows):
    """(fixed MiB, MiB per sequence) through the two largest measured passes of one phase and dtype."""
    measured = sorted((r['sequences'], r['peak_mb']) for r in rows if not r.get('predicted'))
    if len(measured) < 2:
        return None
    (p0, m0), (p1, m1) = measured[-2:]
    per_sequence = (m1 - m0) / (p1 - p0)
    return m1 - per_sequence * p1, per_sequence


def largest_pass(model, budget_gb):
    """The largest number of sequences per pass whose predicted peak fits budget_gb on a GPU."""
    fixed, per_sequence = model
    room = (budget_gb - CUDA_OVERHEAD_GB) * 1024 - fixed
    return max(int(room // per_sequence), 0) if per_sequence > 0 else None


def gb(mb):
    return f'{mb / 1024:.2f}'


def markdown(rows, shapes, dtypes):
    """The table: one row per phase and pass size, a column per dtype (predicted figures in italics), then
    the fits and the largest pass each GPU size holds."""
    head = ' | '.join(f'{d} peak GB' for d in dtypes)
    out = [f'| experiments | phase | sequences per pass | {head} | models GB |',
           '|---|---|---:|' + '---:|' * len(dtypes) + '---:|']
    by_key = {(r['shape'], r['phase'], r['sequences'], r['dtype']): r for r in rows}
    fits = []
    for shape_name, shape in shapes.items():
        for phase in PHASES:
            sizes = sorted({r['sequences'] for r in rows if r['shape'] == shape_name and r['phase'] == phase}, reverse=True)
            n = phase_sequences(shape, phase)
            for size in sizes:
                cells = []
                for d in dtypes:
                    r = by_key.get((shape_name, phase, size, d))
                    cells.append('-' if r is None else f'*{gb(r["peak_mb"])}*' if r.get('predicted') else gb(r['peak_mb']))
                models = next(by_key[k]['models_mb'] for k in by_key if k[:3] == (shape_name, phase, size))
                what = f'{size} (no split: {shape.ranks} ranks x {n // shape.ranks})' if size == n else \
                    f'{size} (microbatch_size {size})'
                out.append(f'| {shape.experiments} (q{shape.query_length}+r{shape.response_length}) | {phase} | '
                           f'{what} | {" | ".join(cells)} | {gb(models)} |')
            for d in dtypes:
                model = fit([r for r in rows if (r['shape'], r['phase'], r['dtype']) == (shape_name, phase, d)])
                if model:
                    fits.append((shape, phase, d, model))
    if fits:
        out += ['', '| experiments | phase | dtype | fixed GB | MB per sequence | ' +
                ' | '.join(f'largest pass in {g} GB' for g in GPU_GB) + ' |',
                '|---|---|---|---:|---:|' + '---:|' * len(GPU_GB)]
        for shape, phase, d, model in fits:
            n = phase_sequences(shape, phase)
            cells = []
            for g in GPU_GB:
                k = largest_pass(model, g)
                cells.append('all' if k is not None and k >= n else str(k))
            out.append(f'| {shape.experiments} | {phase} | {d} | {gb(model[0])} | {model[1]:.0f} | {" | ".join(cells)} |')
    return '\n'.join(out)


def available_gb():
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0] / 2 ** 30
    meminfo = Path('/proc/meminfo').read_text()
    return int(next(ln.split()[1] for ln in meminfo.splitlines() if ln.startswith('MemAvailable'))) / 2 ** 20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--preset', choices=sorted(PRESETS), default='gpt2')
    p.add_argument('--shapes', nargs='+', choices=('books', 'tldr'), default=['books', 'tldr'])
    p.add_argument('--phases', nargs='+', choices=PHASES, default=list(PHASES))
    p.add_argument('--dtypes', nargs='+', choices=('fp32', 'bf16'), default=['fp32'])
    p.add_argument('--max-gb', type=float, default=None,
                   help='measure no pass predicted to need more (default: 80%% of the memory available now)')
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
    shapes = {name: shape for name, shape in paper_shapes().items() if name in args.shapes}
    if args.table:
        runs = {path: json.loads(Path(path).read_text()) for path in args.table}
        if len({json.dumps(run['model'], sort_keys=True) for run in runs.values()}) > 1:
            p.error(f'--table: the runs measured different models: {", ".join(runs)}')
        rows = [r for run in runs.values() for r in run['rows'] if r['shape'] in shapes and r['phase'] in args.phases]
        print(markdown(rows, shapes, args.dtypes))
        return
    info = machine_info()
    max_gb = args.max_gb if args.max_gb is not None else 0.8 * available_gb()
    print(f'machine: {info["cpu"]}, {info["cores"]} cores, torch {info["torch"]}'
          + (f', {info["cuda"]}' if info['cuda'] else ' (CPU: peak RSS as the proxy)')
          + f'; measuring passes predicted to need up to {max_gb:.1f} GB', flush=True)
    print(f'model: {m}', flush=True)
    started = time.time()
    rows = []
    for shape in shapes.values():
        print(f'\n== {shape} ==', flush=True)
        for phase in args.phases:
            for dtype in args.dtypes:
                done = []
                for size in pass_sizes(shape, phase):
                    model = fit(done)
                    predicted_mb = None if model is None else model[0] + model[1] * size
                    if predicted_mb is not None and predicted_mb > max_gb * 1024:
                        r = dict(peak_mb=predicted_mb, models_mb=done[-1]['models_mb'], seconds=0.0, predicted=True)
                    else:
                        r = measure(m, shape, phase, dtype, size, args.threads)
                    row = dict(shape=shape.name, phase=phase, sequences=size, dtype=dtype, **r)
                    done.append(row)
                    rows.append(row)
                    print(f'{shape.name:5s} {phase:11s} {size:4d} sequences {dtype}: peak {gb(r["peak_mb"])} GB'
                          + (' (predicted)' if r.get('predicted') else f' (models {gb(r["models_mb"])} GB), '
                                                                        f'{r["seconds"]:.1f} s'), flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(dict(machine=info, model=m, rows=rows,
                                                                   shapes={k: dataclasses.asdict(v) for k, v in shapes.items()}), indent=1))
    print('\n' + markdown(rows, shapes, args.dtypes))
    print(f'\ntotal wall time {time.time() - started:.0f} s')


if __name__ == '__main__':
    main()
