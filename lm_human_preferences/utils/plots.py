"""Learning curves from a run's stats files, as PNG (no original: it had TensorBoard only).

The trainers append one JSON line per logged step to <save_dir>/train_reward_stats.jsonl and
<save_dir>/train_policy_stats.jsonl (utils/run.py) and call plot_learning_curves(save_dir) at the end,
which writes train_reward_curves.png / train_policy_curves.png beside them. The command line is
`python sample.py plot --save_dir SAVE_DIR [--out F.png]`.

A metric missing from the stats (an older run, a fixed KL coefficient) only drops its panel.
"""

import json
import os
import sys

STATS_FILES = dict(reward='train_reward_stats.jsonl', policy='train_policy_stats.jsonl')
HPARAMS_FILES = dict(reward='train_reward_hparams.json', policy='train_policy_hparams.json')
PNG_FILES = dict(reward='train_reward_curves.png', policy='train_policy_curves.png')

# (metric, panel title) per panel, in order.
POLICY_PANELS = [
    ('objective/score', 'objective/score (reward model)'),
    ('objective/kl', 'objective/kl (nats per response)'),
    ('objective/kl_coef', 'objective/kl_coef'),
    ('objective/entropy', 'objective/entropy (nats per response)'),
    ('ppo/val/var_explained', 'ppo/val/var_explained'),
]
REWARD_PANELS = [
    ('loss', 'reward model loss'),  # the minibatch loss, with eval/loss
    ('accuracy', 'reward model accuracy'),  # eval/accuracy and eval_train/accuracy
]


def read_stats(path):
    """{metric: ([steps], [values])} from a stats JSONL file, steps increasing. A step logged twice
    (a resumed run logs again from its checkpoint) keeps its last value."""
    by_step = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f'{path} line {i + 1} is not valid JSON: {e.msg}') from None
            if not isinstance(row, dict) or 'step' not in row:
                raise ValueError(f'{path} line {i + 1}: expected an object with a "step" key')
            by_step.setdefault(int(row['step']), {}).update(row)
    series = {}
    for step in sorted(by_step):
        for k, v in by_step[step].items():
            if k != 'step' and isinstance(v, (int, float)):
                steps, values = series.setdefault(k, ([], []))
                steps.append(step)
                values.append(float(v))
    return series


def _nested_get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def _read_hparams(save_dir, kind):
    path = os.path.join(save_dir, HPARAMS_FILES[kind])
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _ema(values, alpha=0.1):
    out, m = [], None
    for v in values:
        m = v if m is None else (1 - alpha) * m + alpha * v
        out.append(m)
    return out


def _policy_panel(ax, metric, series, hparams):
    steps, values = series[metric]
    if len(values) > 10:
        ax.plot(steps, values, color='C0', alpha=0.3, linewidth=1)
        ax.plot(steps, _ema(values), color='C0', linewidth=1.5, label='EMA 0.1')
    else:
        ax.plot(steps, values, color='C0', marker='o', markersize=3)
    if metric == 'objective/kl':
        target = _nested_get(hparams, 'rewards', 'adaptive_kl', 'target')
        if target is not None:
            ax.axhline(target, color='C3', linestyle='--', linewidth=1, label=f'adaptive target {target:g}')
    ax.set_xlabel('PPO batch')


def _reward_panel(ax, metric, series, hparams):
    if metric == 'loss':
        steps, values = series['loss']
        ax.plot(steps, values, color='C0', alpha=0.3, linewidth=1)
        ax.plot(steps, _ema(values), color='C0', linewidth=1.5, label='train minibatch (EMA 0.1)')
        for name, color in (('eval/loss', 'C3'), ('eval_train/loss', 'C2')):
            if name in series:
                ax.plot(*series[name], color=color, marker='o', linestyle='none', label=name)
        ax.set_xlabel('reward model minibatch')
        return
    # Accuracy is evaluated once, after training: a bar per evaluated label set, with chance.
    names = [n for n in ('eval/accuracy', 'eval_train/accuracy') if n in series]
    accuracies = [series[n][1][-1] for n in names]
    bars = ax.bar(names, accuracies, color=['C3', 'C2'][:len(names)])
    ax.bar_label(bars, labels=[f'{100 * a:.1f}%' for a in accuracies])
    label_type = _nested_get(hparams, 'labels', 'type') or ''
    if label_type.startswith('best_of_'):
        chance = 1 / int(label_type[len('best_of_'):])
        ax.axhline(chance, color='k', linestyle='--', linewidth=1, label=f'chance {100 * chance:.0f}%')
    ax.set_ylim(0, 1)


def _panels(save_dir, kind):
    """[(draw(ax), title)] of the panels that kind's stats in save_dir have; None without the file."""
    path = os.path.join(save_dir, STATS_FILES[kind])
    if not os.path.isfile(path):
        return None
    series = read_stats(path)
    hparams = _read_hparams(save_dir, kind)
    if kind == 'policy':
        return [(lambda ax, m=m: _policy_panel(ax, m, series, hparams), title)
                for m, title in POLICY_PANELS if m in series]
    present = dict(loss='loss' in series, accuracy='eval/accuracy' in series or 'eval_train/accuracy' in series)
    return [(lambda ax, m=m: _reward_panel(ax, m, series, hparams), title)
            for m, title in REWARD_PANELS if present[m]]


def _draw(panels, out, *, title):
    import matplotlib
    matplotlib.use('Agg')  # headless: no display on training machines
    import matplotlib.pyplot as plt

    ncols = min(4 if len(panels) > 6 else 3, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax, (draw, panel_title) in zip(axes.flat, panels):
        draw(ax)
        ax.set_title(panel_title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis('off')
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_learning_curves(save_dir):
    """Write train_reward_curves.png / train_policy_curves.png into save_dir for the stats files it
    holds; returns the paths written. Raises FileNotFoundError when it holds neither stats file."""
    written = []
    for kind in ('reward', 'policy'):
        panels = _panels(save_dir, kind)
        if panels:
            title = f"{'train_reward' if kind == 'reward' else 'train_policy'}: {os.path.normpath(save_dir)}"
            written.append(_draw(panels, os.path.join(save_dir, PNG_FILES[kind]), title=title))
        elif panels is not None:
            print(f'plots: {os.path.join(save_dir, STATS_FILES[kind])} has none of the plotted metrics', file=sys.stderr)
    if not written and all(_panels(save_dir, k) is None for k in STATS_FILES):
        raise FileNotFoundError(f'no stats to plot in {save_dir}: expected {" or ".join(STATS_FILES.values())}')
    return written


def plot_combined(save_dir, out, *, title=None, extra_panels=()):
    """All panels of both stats files of save_dir (policy first), and extra_panels ((draw(ax), title)
    pairs, e.g. the demo's rule score), in one figure at out."""
    panels = [p for kind in ('policy', 'reward') for p in (_panels(save_dir, kind) or [])]
    if not panels:
        raise FileNotFoundError(f'no stats to plot in {save_dir}: expected {" or ".join(STATS_FILES.values())}')
    return _draw(panels + list(extra_panels), out, title=title or os.path.normpath(save_dir))
