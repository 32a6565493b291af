"""The demo's whole command (`python launch.py train_policy demo NAME`) with one intra-op thread and with two,
alternating in one slot: each phase's seconds side by side, and whether the two learned the same (the report's
numbers). Run it where nothing else runs; the demo's choice (demo/experiment.py's cpu_threads) follows from it.

    python benchmarks/demo_threads.py [--repeats 2] [--threads 1,2] [--out DIR]

Each run has a save dir of its own under --out (default: a temporary dir) and the caches as they are (the demo's
published initial model and labels: nothing made). LMHP_CPU_THREADS sets the threads (offline/experiment.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# What the report says the run learned (and the KL it paid): equal for two runs that computed the same.
LEARNED = ('rule_initial_mean', 'rule_trained_mean', 'rm_heldout_accuracy', 'kl', 'kl_coef_end')


def run(threads, save_dir):
    env = dict(os.environ, LMHP_CPU_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    start = time.time()
    subprocess.run([sys.executable, 'launch.py', 'train_policy', 'demo', 'threads', '--save_dir', save_dir],
                   cwd=REPO_ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    report = json.loads((Path(save_dir) / 'threads' / 'demo_report.json').read_text())  # --save_dir: the runs' parent
    return time.time() - start, report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--repeats', type=int, default=2)
    p.add_argument('--threads', default='1,2')
    p.add_argument('--out')
    args = p.parse_args()
    out = args.out or tempfile.mkdtemp(prefix='demo_threads-')
    counts = [int(t) for t in args.threads.split(',')]
    results = {t: [] for t in counts}
    for repeat in range(args.repeats):
        for threads in counts:
            seconds, report = run(threads, os.path.join(out, f'threads{threads}-{repeat}'))
            results[threads].append((seconds, report))
            phases = ', '.join(f'{k} {v:.0f}' for k, v in report['phase_times_s'].items())
            print(f'threads {threads}, repeat {repeat}: {seconds:.0f} s ({phases}); load {os.getloadavg()[0]:.1f}',
                  flush=True)
    print(f"\n| phase | {' | '.join(f'{t} thread(s), best of {args.repeats}' for t in counts)} |")
    print(f"|---|{'---:|' * len(counts)}")
    phases = list(results[counts[0]][0][1]['phase_times_s'])
    for phase in ['whole command'] + phases:
        cells = []
        for t in counts:
            times = [s if phase == 'whole command' else r['phase_times_s'][phase] for s, r in results[t]]
            cells.append(f'{min(times):.0f} s')
        print(f"| {phase} | {' | '.join(cells)} |")
    learned = {t: [{k: r.get(k) for k in LEARNED} for _, r in results[t]] for t in counts}
    for t in counts:
        print(f'{t} thread(s) learned: {learned[t][0]}' + ('' if all(x == learned[t][0] for x in learned[t])
                                                          else ' (the repeats differ!)'))
    first = learned[counts[0]][0]
    print('the same numbers for every thread count' if all(learned[t][0] == first for t in counts)
          else 'other numbers with other thread counts (the products block otherwise)')


if __name__ == '__main__':
    main()
