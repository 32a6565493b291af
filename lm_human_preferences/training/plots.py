"""Learning curves from a run's stats files, as PNG (no original: it had TensorBoard only).

The trainers append one JSON line per logged step to <save_dir>/train_reward_stats.jsonl and
<save_dir>/train_policy_stats.jsonl (training/run.py) and call plot_learning_curves(save_dir) at the end,
which writes train_reward_curves.png / train_policy_curves.png beside them. The command line is
`python sample.py plot --save_dir SAVE_DIR [--out F.png]`.

A noisy metric is drawn as logged ("raw" in the legend) and as its EMA; a value a controller set (the
adaptive KL coefficient) as logged only. A metric missing from the stats (an older run, a fixed KL
coefficient) only drops its panel. The panels fill their rows: no slot of a figure stays empty.
"""

import json
import math
import os
import sys
import warnings

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
    ('online/pi_beats_rho', 'online: pi beats rho\n(validation labels, each round)'),  # ours: online/loop.py
]
REWARD_PANELS = [
    ('loss', 'reward model loss'),  # the minibatch loss, with eval/loss
    ('accuracy', 'reward model accuracy'),  # eval/accuracy and eval_train/accuracy
]


class StatsWarning(UserWarning):
    """The last line of a stats file is no complete row (an append cut off by a kill, a full disk or a power
    cut): dropped."""


def read_rows(path):
    """[(line, row)] of a stats JSONL file, in order: each row a dict with an int "step". The stats are
    derived data: the last line, when it is no complete row (no newline at its end: our appends write it
    last; not JSON; no step), is dropped with a StatsWarning. Any other such line is damage no append
    leaves: a ValueError naming the file, the line and the fix."""
    with open(path, 'rb') as f:
        lines = f.readlines()  # split at b'\n' alone (bytes.splitlines also splits a torn tail at b'\r')
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        row, why = None, 'not an object with an integer "step"'
        try:
            row = json.loads(line) if line.endswith(b'\n') else None
        except json.JSONDecodeError as e:
            why = f'not valid JSON ({e})'
        except UnicodeDecodeError:
            why = 'not UTF-8 text'
        if isinstance(row, dict) and isinstance(row.get('step'), int):
            rows.append((line, row))
        elif i == len(lines) - 1:
            warnings.warn(f'{path}: dropping its last line, which is no complete stats row (an append cut off by '
                          f'a kill or a full disk): {line[:60]!r}', StatsWarning, stacklevel=2)
        else:
            raise ValueError(f'{path} line {i + 1} is {why}, with lines after it (no append leaves that): delete '
                             f'that line and rerun (the stats are derived data: only its curve point is lost)')
    return rows


def read_stats(path):
    """{metric: ([steps], [values])} from a stats JSONL file (read_rows), steps increasing. A step logged
    twice (a resumed run logs again from its checkpoint) keeps its last value."""
    by_step = {}
    for _, row in read_rows(path):
        by_step.setdefault(row['step'], {}).update(row)
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


EMA_ALPHA = 0.1
# Values a controller sets (the adaptive KL coefficient), not noisy estimates: smoothing would only
# shift them (an EMA lags the value the run used), so they are drawn as logged.
UNSMOOTHED = {'objective/kl_coef'}


def _ema(values, alpha=EMA_ALPHA):
    out, m = [], None
    for v in values:
        m = v if m is None else (1 - alpha) * m + alpha * v
        out.append(m)
    return out


def _curve(ax, steps, values, *, raw_label, smooth=True):
    """A metric per step: the raw values, labelled raw_label, and, when smooth and there are more than 10,
    their EMA."""
    if smooth and len(values) > 10:
        ax.plot(steps, values, color='C0', alpha=0.3, linewidth=1, label=raw_label)
        ax.plot(steps, _ema(values), color='C0', linewidth=1.5, label=f'EMA {EMA_ALPHA:g} (smoothed)')
    else:
        ax.plot(steps, values, color='C0', linewidth=1.5, marker='o' if len(values) <= 10 else None, markersize=3,
                label=raw_label)


def _reference_lines(ax, lines):
    """Horizontal reference lines: (value, label, color, linestyle)."""
    for value, label, color, linestyle in lines:
        ax.axhline(value, color=color, linestyle=linestyle, linewidth=1, label=label)


def _policy_panel(ax, metric, series, hparams):
    if metric == 'online/pi_beats_rho':  # a share of the labels of each round, against a coin's
        _curve(ax, *series[metric], raw_label='each round', smooth=False)
        _reference_lines(ax, [(0.5, 'chance (as many of each)', 'k', '--')])
        ax.set_ylim(0, 1)
        ax.set_xlabel('PPO batch')
        return
    _curve(ax, *series[metric], raw_label='each PPO batch (raw)', smooth=metric not in UNSMOOTHED)
    if metric == 'objective/kl':
        target = _nested_get(hparams, 'rewards', 'adaptive_kl', 'target')
        if target is not None:
            _reference_lines(ax, [(target, f'adaptive target {target:g}', 'C3', '--')])
    ax.set_xlabel('PPO batch')


# The reward model's evaluations after training (train_reward.evaluate): (stats prefix, labels, color).
EVALS = [('eval', 'held-out labels', 'C3'), ('eval_train', 'training labels', 'C2')]


def _reward_panel(ax, metric, series, hparams):
    if metric == 'loss':
        _curve(ax, *series['loss'], raw_label='each train minibatch (raw)')
        for prefix, labels, color in EVALS:
            if f'{prefix}/loss' in series:
                ax.plot(*series[f'{prefix}/loss'], color=color, marker='o', linestyle='none',
                        label=f'{prefix}/loss ({labels})')
        ax.set_xlabel('reward model minibatch')
        return
    # Accuracy is evaluated once, after training: a bar per evaluated label set, with chance.
    bars = [(f'{labels}\n({prefix}/accuracy)', series[f'{prefix}/accuracy'][1][-1], color)
            for prefix, labels, color in EVALS if f'{prefix}/accuracy' in series]
    drawn = ax.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars], width=0.5)
    # inside the bars: above them the values would collide with the reference lines
    ax.bar_label(drawn, labels=[f'{100 * b[1]:.1f}%' for b in bars], label_type='center', color='white')
    ax.set_xlim(-0.75, len(bars) - 0.25)  # bars of the same width, one or two
    label_type = _nested_get(hparams, 'labels', 'type') or ''
    if label_type.startswith('best_of_'):
        chance = 1 / int(label_type[len('best_of_'):])
        _reference_lines(ax, [(chance, f'chance {100 * chance:.0f}%', 'k', '--')])
    ax.set_ylim(0, 1)


def _panels(save_dir, kind, references=None):
    """[(draw(ax), title)] of the panels that kind's stats in save_dir have; None without the file.
    references: {panel ('objective/kl', ..., 'loss', 'accuracy'): [(value, label, color, linestyle)]},
    horizontal lines the caller adds to those panels (e.g. the demo's best possible accuracy)."""
    path = os.path.join(save_dir, STATS_FILES[kind])
    if not os.path.isfile(path):
        return None
    series = read_stats(path)
    hparams = _read_hparams(save_dir, kind)
    draw_panel, titles = (_policy_panel, POLICY_PANELS) if kind == 'policy' else (_reward_panel, REWARD_PANELS)
    present = dict(loss='loss' in series, accuracy=any(f'{prefix}/accuracy' in series for prefix, _, _ in EVALS))

    def draw(ax, panel):
        draw_panel(ax, panel, series, hparams)
        _reference_lines(ax, (references or {}).get(panel, ()))
    return [(lambda ax, panel=panel: draw(ax, panel), title) for panel, title in titles
            if present.get(panel, panel in series)]


def _rows(n):
    """The number of panels in each row of a figure of n: at most 3 a row (4 above 6 panels), the rows
    as even as possible."""
    ncols = min(4 if n > 6 else 3, n)
    nrows = (n + ncols - 1) // ncols
    return [n // nrows + (i < n % nrows) for i in range(nrows)]


def figure(panels, *, title):
    """A matplotlib figure of panels ((draw(ax), title) pairs), in rows (_rows) that fill the figure's
    width: a shorter row's panels are wider, so no slot stays empty."""
    import matplotlib
    matplotlib.use('Agg')  # headless: no display on training machines
    import matplotlib.pyplot as plt

    rows = _rows(len(panels))
    width = math.lcm(*rows)  # grid columns: every row's panels span an equal whole number of them
    fig = plt.figure(figsize=(4.2 * rows[0], 3.2 * len(rows)))
    grid = fig.add_gridspec(len(rows), width)
    panel_iter = iter(panels)
    for r, n in enumerate(rows):
        span = width // n
        for c in range(n):
            draw, panel_title = next(panel_iter)
            ax = fig.add_subplot(grid[r, c * span:(c + 1) * span])
            draw(ax)
            ax.set_title(panel_title, fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _draw(panels, out, *, title):
    fig = figure(panels, title=title)
    import matplotlib.pyplot as plt  # after figure() chose the headless backend
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_learning_curves(save_dir, kinds=('reward', 'policy')):
    """Write train_reward_curves.png / train_policy_curves.png into save_dir for the stats files it
    holds (of kinds: a trainer draws its own); returns the paths written. Raises FileNotFoundError when it
    holds neither stats file."""
    written = []
    for kind in kinds:
        panels = _panels(save_dir, kind)
        if panels:
            title = f"{'train_reward' if kind == 'reward' else 'train_policy'}: {os.path.normpath(save_dir)}"
            written.append(_draw(panels, os.path.join(save_dir, PNG_FILES[kind]), title=title))
        elif panels is not None:
            print(f'plots: {os.path.join(save_dir, STATS_FILES[kind])} has none of the plotted metrics',
                  file=sys.stderr)
    if not written and all(_panels(save_dir, k) is None for k in kinds):
        expected = ' or '.join(STATS_FILES[k] for k in kinds)
        raise FileNotFoundError(f'no stats to plot in {save_dir}: expected {expected}')
    return written


def plot_combined(save_dir, out, *, title=None, extra_panels=(), references=None):
    """All panels of both stats files of save_dir (policy first), and extra_panels ((draw(ax), title)
    pairs, e.g. the demo's rule score), in one figure at out; references: lines to add to panels (see
    _panels), e.g. the demo's best possible reward model accuracy."""
    panels = [p for kind in ('policy', 'reward') for p in (_panels(save_dir, kind, references) or [])]
    if not panels:
        raise FileNotFoundError(f'no stats to plot in {save_dir}: expected {" or ".join(STATS_FILES.values())}')
    return _draw(panels + list(extra_panels), out, title=title or os.path.normpath(save_dir))
