"""The sentiment miniature offline (its reward model trained once, on labels of the initial policy's samples) against
the paper's online loop at the same number of labels (a quarter of them first, then three rounds of a quarter each
on the current policy's samples, the reward model retrained from a fresh head on all so far), VADER in the
labelers' seat in both, for each seed. Prints a markdown table from the runs' reports: VADER's gain, the KL, and
the final reward model's accuracy on best-of-4 questions of test queries with the initial policy's responses and
with the trained policy's (the paper's distributional shift), beside VADER's ceiling on each.

    python benchmarks/online_vs_offline.py --seeds 1 2 3 [--out /tmp/online-vs-offline] [--retrains 3]

A seed's runs share its cached initial model (saved_models/) and each setting's cached labels (datasets/); the
reports are deterministic on a given CPU, so the machine may be busy.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LABELS = 16384  # both arms' labels, as docs/labeling.md's table was made; the miniature's own run binds 8,192


def run(name, out, seed, extra):
    report = out / name / 'sentiment_mini_report.json'
    if not report.exists():
        started = time.time()
        proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'sentiment_mini', name, '--save_dir', str(out),
                               '--run.seed', str(seed), *extra], cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f'{name} failed:\n{proc.stderr[-3000:]}')
        print(f'{name}: {time.time() - started:.0f} s', file=sys.stderr, flush=True)
    return json.loads(report.read_text())


def row(setting, seed, r):
    rounds = r.get('online_rounds', [])
    wins = ', '.join(f"{100 * x['pi_beats_rho']:.0f} %" for x in rounds if 'pi_beats_rho' in x) or '—'
    return (f"| {seed} | {setting} | **{r['vader_gain_initial_stds']:+.2f}** ± {r['vader_gain_initial_stds_se']:.2f} | "
            f"{r['kl']:.2f} | {100 * r['rm_accuracy_initial_samples']:.1f} % "
            f"({100 * r['rm_accuracy_initial_samples_ceiling']:.1f} %) | {100 * r['rm_accuracy_trained_samples']:.1f} % "
            f"({100 * r['rm_accuracy_trained_samples_ceiling']:.1f} %) | {wins} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seeds', type=int, nargs='+', default=[1, 2, 3])
    parser.add_argument('--retrains', type=int, default=3)
    parser.add_argument('--out', default='/tmp/online-vs-offline')
    args = parser.parse_args()
    out = Path(args.out)
    first = LABELS // (args.retrains + 1)
    online = ['--online.retrains', str(args.retrains), '--online.num_labels', str(LABELS - first),
              '--rewards.train_new_model.labels.num_train', str(first)]
    lines = ["| seed | reward model | VADER gain (sd of the initial policy's) | objective/kl (target 6) | "
             "RM on the initial policy's samples (VADER's ceiling) | RM on the trained policy's samples "
             "(VADER's ceiling) | pi beats rho, each round |", '|---|---|---|---|---|---|---|']
    for seed in args.seeds:
        lines.append(row('offline', seed, run(f'offline-seed{seed}', out, seed,
                                              ['--rewards.train_new_model.labels.num_train', str(LABELS)])))
        lines.append(row(f'online, {args.retrains} retrains', seed, run(f'online-seed{seed}', out, seed, online)))
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
