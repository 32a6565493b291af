"""A timed `train_policy` run of a paper experiment's shapes on random weights: seconds per PPO update,
the run's hours, MFU and peak memory (README "On a GPU").

    python benchmarks/train_timing.py --exp sentiment --model 124M --updates 3 --json books.json
    python benchmarks/train_timing.py --exp tldr --model 124M --updates 3
    python benchmarks/train_timing.py --exp sentiment --model 774M --microbatch 128
    python benchmarks/train_timing.py --exp sentiment --model tiny --updates 2   # smoke run on a CPU

It runs the real command, `launch.py train_policy EXP` with the experiment's 8 ranks in this one process
(`--mpi 8 --procs 1`), everything as the experiment sets it except what a machine without internet must
replace: the policy starts from a random-weights GPT-2 of the chosen shape written as a model dir, the
reward model is that same random model with a random reward head (`rewards.allow_untrained_head`), and
the queries come from `local:` the sentiment miniature's two books (the tldr shapes pad them to its 500
tokens). Speed does not depend on the values of the weights or the text. The first update (CUDA graph
capture, allocator warm-up) is reported apart and left out of the mean.

FLOPs per update are what the work needs (benchmarks/ppo_throughput.py's count: sampling, the reference
logprobs, the scores, `ppo.noptepochs` passes of forward and backward; logits only where they are read);
MFU is that over the time and over the peak a large matrix product reaches on this device in the run's
dtype, measured at the start. `--repo DIR` times another checkout's code (e.g. an older commit's
`git worktree`) with this script.

`--profile N` runs the Nth update (not the set-up, not the warm-up) under torch.profiler and prints where it
went: its wall time, the GPU kernels' summed time and share of it, the kernels by summed time, the ops by
device (or CPU) time with their input shapes, and the host side:

    python benchmarks/train_timing.py --exp sentiment --model 124M --updates 4 --profile 3
"""
import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # GPT-2's release shapes; vocabulary 50,257 and context 1,024 for all
    'tiny': dict(n_layer=2, n_embd=64, n_head=4),
    '124M': dict(n_layer=12, n_embd=768, n_head=12),
    '774M': dict(n_layer=36, n_embd=1280, n_head=20),
}
BOOKS = Path(__file__).resolve().parents[1] / 'lm_human_preferences' / 'sentiment_mini' / 'books'  # the queries' text
RUN_UPDATES = dict(sentiment=1_954, descriptiveness=1_954, tldr=31_250, cnndm=31_250)  # 1M episodes / batch


def profile_update(train_policy, at):
    """Profile PPOTrainer.step's `at`-th call (1-based); returns a function that prints the profile."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, state = train_policy.PPOTrainer.step, dict(calls=0, prof=None, wall=None)

    def profiled(self):
        state['calls'] += 1
        if state['calls'] != at:
            return step(self)
        sync()
        prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, record_shapes=True)
        started = time.perf_counter()
        with prof:
            result = step(self)
            sync()
        state.update(prof=prof, wall=time.perf_counter() - started)
        return result
    train_policy.PPOTrainer.step = profiled

    def report():
        prof, wall = state['prof'], state['wall']
        if prof is None:
            sys.exit(f'train_timing: update {at} never ran (--updates is too small)')
        from torch.autograd import DeviceType
        kernels = [e for e in prof.events() if getattr(e, 'device_type', None) == DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
        graphs = sum(e.name == 'cudaGraphLaunch' for e in prof.events())
        print(f'\nprofiled update {at}: wall {wall * 1e3:.0f} ms' + (
            f'; GPU kernels {busy * 1e3:.0f} ms ({busy / wall:.0%} of wall), {len(kernels)} kernels, {graphs} graph '
            f'launches' if cuda else ''))
        if cuda:
            by_name = {}
            for e in kernels:
                t, n = by_name.get(e.name[:90], (0, 0))
                by_name[e.name[:90]] = (t + e.time_range.elapsed_us(), n + 1)
            print('kernels by summed time:')
            for name, (t, n) in sorted(by_name.items(), key=lambda x: -x[1][0])[:25]:
                print(f'  {t / 1e3:8.1f} ms {n:6d}x  {name}')
        own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        print(f'ops by self {"device" if cuda else "CPU"} time, with input shapes:')
        for e in sorted(prof.key_averages(group_by_input_shape=True), key=own, reverse=True)[:30]:
            print(f'  {own(e) / 1e3:8.1f} ms {e.count:6d}x  {e.key[:40]:40s} {str(e.input_shapes)[:150]}')
        if cuda:
            print('host side by self CPU time:')
            for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]:
                print(f'  {e.self_cpu_time_total / 1e3:8.1f} ms {e.count:6d}x  {e.key[:80]}')
    return report


class Tee(io.TextIOBase):
    """Prints what the trainer prints and keeps it, to read its step times."""
    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, s):
        self.text.append(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--exp', default='sentiment', choices=sorted(RUN_UPDATES))
    p.add_argument('--model', default='124M', choices=sorted(SHAPES))
    p.add_argument('--updates', type=int, default=3, help='PPO updates to run (the first is warm-up)')
    p.add_argument('--microbatch', default=None, help="run.microbatch_size (default: the experiment's)")
    p.add_argument('--bf16', default=None, choices=['true', 'false'], help="run.bf16 (default: on with CUDA)")
    p.add_argument('--repo', default=str(Path(__file__).resolve().parents[1]), help='the checkout to time')
    p.add_argument('--json', default=None)
    p.add_argument('--profile', type=int, default=None, metavar='N', help='profile the Nth update')
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ppo_throughput import Workload, line_flops, measure_matmul_peak
    # The package of the checkout to time, not this script's (which ppo_throughput put on the path).
    repo = Path(args.repo).resolve()
    for name in [n for n in sys.modules if n.startswith('lm_human_preferences')]:
        del sys.modules[name]
    sys.path.insert(0, str(repo))
    os.chdir(repo)
    # An older checkout downloads GPT-2's BPE files unless this names a dir of them: ours ship them.
    os.environ.setdefault('LMHP_GPT2_ENCODING_DIR', str(BOOKS.parents[1] / 'language' / 'gpt2_bpe'))
    from lm_human_preferences import train_policy
    from lm_human_preferences.language import checkpoints, encodings, model
    from lm_human_preferences.utils import launch as launch_utils
    assert Path(model.__file__).resolve().is_relative_to(repo), model.__file__
    import importlib.util
    spec = importlib.util.spec_from_file_location('launch_script', repo / 'launch.py')
    launch_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch_script)

    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    bf16 = args.bf16 == 'true' if args.bf16 else device.type == 'cuda'
    # the MFU denominator: a GPU reaches its peak only on large products
    peak = measure_matmul_peak(torch.bfloat16 if bf16 else torch.float32,
                               sizes=(8192,) if device.type == 'cuda' else (1024, 2048))

    m = dict(n_vocab=50257, n_ctx=1024, **SHAPES[args.model])
    work = Path(tempfile.mkdtemp(prefix='train_timing-'))
    model_dir = work / f'random-{args.model}'
    hp = model.HParams()
    hp.override_from_dict(m)
    torch.manual_seed(0)
    checkpoints.save_checkpoint(str(model_dir), 0, model.Model(hp), hparams=hp, encoding=encodings.Main)

    # The experiment's batch and shapes, as launch.py sets them.
    trial = {k: v for k, v, _ in launch_script.get_experiments()[args.exp][0] if k is not None}
    batch = trial['ppo.batch_size']
    argv = ['train_policy', args.exp, 'timed', '--save_dir', str(work / 'save'), '--mpi', '8', '--procs', '1',
            '--task.policy.initial_model', str(model_dir), '--rewards.trained_model', str(model_dir),
            '--rewards.train_new_model', 'off', '--rewards.allow_untrained_head', 'true',
            '--task.query_dataset', f'local:{BOOKS}',
            '--ppo.total_episodes', str(args.updates * batch), '--run.save_interval', '1000000']
    if args.microbatch:
        argv += ['--run.microbatch_size', args.microbatch]
    if args.bf16:
        argv += ['--run.bf16', args.bf16]
    print('train_timing:', ' '.join(argv), flush=True)

    report_profile = profile_update(train_policy, args.profile) if args.profile else None
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats()
    tee = Tee(sys.stdout)
    started = time.time()
    with contextlib.redirect_stdout(tee):
        try:
            launch_utils.main(dict(train_policy=launch_script.launch_train_policy), argv=argv)
        except SystemExit as e:
            if e.code:
                raise
    wall = time.time() - started
    step_times = [float(s) for s in re.findall(r'\[ppo_step \d+\] step_time=([0-9.]+)s', ''.join(tee.text))]
    if len(step_times) < 2:
        sys.exit(f'train_timing: expected {args.updates} step times in the output, found {step_times}')

    q, r = trial['task.query_length'], trial['task.response_length']
    flops = line_flops(m, Workload(args.exp, q, r, batch, trial.get('ppo.nminibatches', 1),
                                   trial.get('ppo.noptepochs', 4)), 'ppo_update')
    timed = [t for i, t in enumerate(step_times[1:], start=2) if i != args.profile]  # not the profiled update
    if not timed:
        sys.exit('train_timing: no update left to time besides the first and the profiled one: run more --updates')
    per_update = sum(timed) / len(timed)
    result = dict(
        exp=args.exp, model=args.model, shape=m, dtype='bf16' if bf16 else 'fp32', microbatch=args.microbatch,
        repo=str(repo), device=torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu',
        torch=torch.__version__, cuda=torch.version.cuda, batch=batch, query_length=q, response_length=r,
        updates=len(step_times), first_update_s=step_times[0], step_times_s=step_times,
        seconds_per_update=per_update, run_updates=RUN_UPDATES[args.exp],
        run_hours=per_update * RUN_UPDATES[args.exp] / 3600, flops_per_update=flops, matmul_peak_flops=peak,
        mfu=flops / per_update / peak, wall_s=wall,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == 'cuda' else None)
    print('train_timing result: ' + json.dumps(result))
    print(f"{args.exp} {args.model} {result['dtype']} microbatch {args.microbatch or 'default'}: "
          f"{per_update:.2f} s/update (first {step_times[0]:.1f} s), {result['run_hours']:.2f} h for "
          f"{RUN_UPDATES[args.exp]:,} updates, MFU {result['mfu']:.1%} (peak {peak / 1e12:.0f} TFLOP/s), "
          f"peak memory {result['peak_memory_gib'] or 0:.1f} GiB")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)
    if report_profile:
        report_profile()


if __name__ == '__main__':
    main()
