"""Ours: the frontier's table and plot, from its finished runs' frontier.json files alone (seconds, no model):

    <out>/frontier.jsonl     one row a point: arm, seed, knob, value, gain ± se, KL ± se (measured, or best-of-n's
                             bound), PPO's objective/kl, the reward model's accuracy on the initial policy's samples
                             and on the trained policy's, the command that made it
    <out>/frontier.md        the table in Markdown, and each arm's gain at each KL budget (default 6 nats, the
                             miniature's target, and 12, twice it) per seed, interpolated on that seed's frontier,
                             with their mean ± standard deviation over seeds
    figure                   gain against KL, one colour an arm: each seed's points and the mean curve
    doc                      the Markdown between the doc's markers replaced (the rest of the doc is kept)
"""

import json
import os

import numpy as np

from lm_human_preferences.utils import files

BEGIN, END = '<!-- frontier table: begin (written by `launch.py frontier`) -->', '<!-- frontier table: end -->'
# The README's summary: the gain at the budget and the plot, between these markers where the README has them.
SUMMARY_BEGIN = '<!-- frontier summary: begin (written by `launch.py frontier`) -->'
SUMMARY_END = '<!-- frontier summary: end -->'
COLOURS = dict(ppo='C0', online='C1', best_of_n='C2', dpo='C3')
LABELS = dict(ppo='offline PPO (kl_coef)', online='online PPO, 3 retrains (kl_coef)',
              best_of_n='best-of-n by the reward model (n; KL: the bound)', dpo='DPO, TRL (beta)')

# The arms, each one's knob, and the file that marks a run finished (written last by sweep.py, read here).
ARMS = ('ppo', 'online', 'best_of_n', 'dpo')
KNOBS = dict(ppo='kl_coef', online='kl_coef', best_of_n='n', dpo='beta')
DONE = 'frontier.json'


def minutes(seconds):
    return f'{int(seconds // 60)}m{int(seconds % 60):02d}s'


def _pct(x):
    return '–' if x is None else f'{100 * x:.1f} %'


def points_line(points):
    """A run's points in a progress line."""
    if not points:
        return 'reward model trained'
    return '; '.join((f"{p['value']:g}: " if len(points) > 1 else '') +
                     f"{p['gain']:+.2f} ± {p['gain_se']:.2f} sd at {p['kl']:.2f} nats"
                     + (f" (RM {_pct(p['rm_initial'])} → {_pct(p['rm_trained'])})" if p['rm_trained'] is not None else '')
                     for p in points)


def collect(out, arms=None):
    """Every point of the finished runs under out, as rows (sorted by arm, seed, value)."""
    rows = []
    for seed_dir in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if not seed_dir.startswith('seed') or not os.path.isdir(os.path.join(out, seed_dir)):
            continue
        for run in sorted(os.listdir(os.path.join(out, seed_dir))):
            path = os.path.join(out, seed_dir, run, DONE)
            if not os.path.isfile(path):
                continue
            with open(path) as f:
                done = json.load(f)
            identity = done.get('identity', {})
            if 'arm' not in identity or (arms is not None and identity['arm'] not in arms):
                continue  # the seed's reward model, the initial model's export
            for point in done['points']:
                rows.append(dict(arm=identity['arm'], seed=identity['seed'], knob=KNOBS[identity['arm']], **point,
                                 command=done['command']))
    order = {arm: i for i, arm in enumerate(ARMS)}
    return sorted(rows, key=lambda r: (order[r['arm']], r['seed'], r['kl']))


def gain_at(rows, kl, key='gain'):
    """The gain (or another of the points' values: `key`) at `kl` nats by linear interpolation between the two points
    around it on one seed's frontier of one arm; None when kl lies outside the points' KLs (no extrapolation) or a
    point has no such value."""
    kls, values = [r['kl'] for r in rows], [r[key] for r in rows]
    if not kls or kl < min(kls) or kl > max(kls) or None in values:
        return None
    order = np.argsort(kls)
    return float(np.interp(kl, np.array(kls)[order], np.array(values)[order]))


def own_samples_key(arm):
    """The reward model's accuracy on the arm's own samples: best-of-n's are the initial policy's samples."""
    return 'rm_initial' if arm == 'best_of_n' else 'rm_trained'


def budget_table(rows, budget):
    """{arm: {'seeds': {seed: gain or None}, 'mean': m, 'std': s, 'n': count, 'rm': {seed: accuracy or None}}} of
    the gain at `budget` nats and of the reward model's accuracy on the arm's own samples there."""
    result = {}
    for arm in dict.fromkeys(r['arm'] for r in rows):
        seeds, rm = {}, {}
        for seed in sorted({r['seed'] for r in rows if r['arm'] == arm}):
            frontier = [r for r in rows if r['arm'] == arm and r['seed'] == seed]
            seeds[seed] = gain_at(frontier, budget)
            rm[seed] = gain_at(frontier, budget, own_samples_key(arm))
        result[arm] = dict(seeds=seeds, rm=rm, **spread(seeds.values()))
    return result


def spread(values):
    """{'mean', 'std', 'n'} of the values that are not None (std: the sample standard deviation, None below two)."""
    values = [v for v in values if v is not None]
    return dict(n=len(values), mean=float(np.mean(values)) if values else None,
                std=float(np.std(values, ddof=1)) if len(values) > 1 else None)


def against(budgets, arm, baseline='ppo'):
    """The arm's gain at the budget less the baseline's, paired by seed: {'seeds': {seed: difference or None},
    'mean', 'std', 'n', 'above': seeds where the arm gains more}."""
    mine, theirs = budgets[arm]['seeds'], budgets[baseline]['seeds']
    seeds = {seed: (None if mine[seed] is None or theirs.get(seed) is None else mine[seed] - theirs[seed])
             for seed in mine}
    return dict(seeds=seeds, above=sum(d > 0 for d in seeds.values() if d is not None), **spread(seeds.values()))


def _seed_cells(values, seeds):
    """A table row's per-seed cells of {seed: value or None}."""
    return ['–' if values.get(s) is None else f'{values[s]:+.2f}' for s in seeds]


def _mean(entry):
    """A spread's mean ± sd (the sd only with two values or more), or that the budget is out of its range."""
    if entry['mean'] is None:
        return 'out of its range'
    return f"{entry['mean']:+.2f}" + (f" ± {entry['std']:.2f}" if entry['std'] is not None else '')


def _mean_cell(entry):
    return _mean(entry) + ('' if entry['mean'] is None else f" ({entry['n']} seed{'s' if entry['n'] != 1 else ''})")


def summary(rows, budget):
    """The findings at the budget, in Markdown: each arm's gain per seed and its mean ± sd, the reward model's
    accuracy on the arm's own samples, and each arm against offline PPO paired by seed (docs/frontier.md and the
    README show this)."""
    budgets = budget_table(rows, budget)
    seeds = sorted({r['seed'] for r in rows})
    lines = [f'| arm (knob) | ' + ' | '.join(f'seed {s}' for s in seeds) + ' | mean ± sd | RM on its own samples |',
             '|---|' + '---|' * (len(seeds) + 2)]
    for arm, entry in budgets.items():
        cells = _seed_cells(entry['seeds'], seeds)
        rm = spread(entry['rm'].values())
        rm_cell = '–' if rm['mean'] is None else f"{100 * rm['mean']:.1f} %" + (
            f" ± {100 * rm['std']:.1f}" if rm['std'] is not None else '')
        lines.append(f'| {LABELS[arm]} | ' + ' | '.join(cells) + f' | {_mean_cell(entry)} | {rm_cell} |')
    if 'ppo' in budgets and len(budgets) > 1:
        lines += ['', f'Against offline PPO at {budget:g} nats, paired by seed (the arm\'s gain less offline PPO\'s on the '
                      f'same seed\'s initial model and labels):', '',
                  '| arm | ' + ' | '.join(f'seed {s}' for s in seeds) + ' | mean ± sd | seeds where it gains more |',
                  '|---|' + '---|' * (len(seeds) + 2)]
        for arm in budgets:
            if arm == 'ppo':
                continue
            entry = against(budgets, arm)
            cells = _seed_cells(entry['seeds'], seeds)
            lines.append(f'| {LABELS[arm]} | ' + ' | '.join(cells) + f' | {_mean_cell(entry)} | '
                         f"{entry['above']} of {entry['n']} |")
    return '\n'.join(lines) + '\n'


def markdown(rows, kl_budgets, *, command, figure=None):
    lines = [f'Made by `{command}` from its runs\' results. Gain: VADER\'s score of the trained policy\'s samples less '
             f'the initial policy\'s, in standard deviations of the initial policy\'s scores (± its standard error); KL: '
             f'KL(π ‖ ρ) in nats a response, measured on the test queries\' samples as PPO\'s objective/kl (best-of-n: '
             f'its bound log n − (n−1)/n); RM: the reward model\'s accuracy on best-of-4 questions of the initial '
             f'policy\'s samples → of the trained policy\'s (the distributional shift).', '']
    if figure:
        lines += [f'![gain against KL]({figure})', '']
    for budget in kl_budgets:
        lines += [f'### Gain at {budget:g} nats, interpolated on each seed\'s frontier', '',
                  summary(rows, budget).rstrip('\n'), '']
    lines += ['### Every point', '', '| arm | seed | knob | gain ± se | KL (nats) | PPO objective/kl | RM: initial → '
              'trained samples | command |', '|---|---|---|---|---|---|---|---|']
    for r in rows:
        kl = f"{r['kl']:.2f} ± {r['kl_se']:.2f}" if r['kl_kind'] == 'measured' else f"≤ {r['kl']:.2f} (bound)"
        objective = '–' if r['kl_objective'] is None else f"{r['kl_objective']:.2f}"
        lines.append(f"| {r['arm']} | {r['seed']} | {r['knob']} {r['value']:g} | {r['gain']:+.2f} ± {r['gain_se']:.2f} "
                     f"| {kl} | {objective} | {_pct(r['rm_initial'])} → {_pct(r['rm_trained'])} | `{r['command']}` |")
    return '\n'.join(lines) + '\n'


def plot(rows, path, *, kl_budgets, title):
    """Gain against KL: each seed's points (marker by seed), each arm's mean curve over seeds (the points of the same
    knob value averaged), the budgets marked."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = 'osD^vP*X'
    seeds = sorted({r['seed'] for r in rows})
    for arm in dict.fromkeys(r['arm'] for r in rows):
        mine = [r for r in rows if r['arm'] == arm]
        for i, seed in enumerate(seeds):
            pts = [r for r in mine if r['seed'] == seed]
            ax.errorbar([r['kl'] for r in pts], [r['gain'] for r in pts], yerr=[r['gain_se'] for r in pts],
                        fmt=markers[i % len(markers)], color=COLOURS[arm], alpha=0.45, ms=5, capsize=2)
        values = sorted({r['value'] for r in mine})
        mean = [(np.mean([r['kl'] for r in mine if r['value'] == v]), np.mean([r['gain'] for r in mine if r['value'] == v]))
                for v in values]
        mean.sort()
        ax.plot([m[0] for m in mean], [m[1] for m in mean], '-', color=COLOURS[arm], lw=2, label=LABELS[arm])
    for i, seed in enumerate(seeds):
        ax.plot([], [], markers[i % len(markers)], color='grey', label=f'seed {seed}')
    for budget in kl_budgets:
        ax.axvline(budget, color='grey', ls=':', lw=1)
    # A log axis: the knobs span 2 to 10 nats, but a run can land far past them (online PPO at a small kl_coef: 38
    # nats), which on a linear axis squeezes every other point into its left third. symlog only if a KL is <= 0.
    kls = [r['kl'] for r in rows]
    ax.set_xscale('log' if min(kls) > 0 else 'symlog')
    ticks = [m * 10.0 ** e for e in range(-2, 4) for m in (1, 2, 5) if min(kls) / 2 <= m * 10.0 ** e <= max(kls) * 2]
    ax.set_xticks(ticks, [f'{t:g}' for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel('KL(π ‖ ρ), nats a response (log scale)')
    ax.set_ylabel("VADER gain, sd of the initial policy's scores")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='best')
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f'{path}.tmp-{os.getpid()}.png'
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write(out, *, arms, kl_budgets, command, figure, doc, readme=None):
    """The table (frontier.jsonl, frontier.md under out), the figure, the doc's table and the readme's summary
    (where it has the SUMMARY markers: the first budget's) from the finished runs; returns the rows."""
    rows = collect(out, arms)
    if not rows:
        print(f'frontier: no finished run in {out} yet: nothing to tabulate')
        return rows
    files.atomic_write(os.path.join(out, 'frontier.jsonl'), ''.join(json.dumps(r) + '\n' for r in rows).encode())
    title = f'{command}: {len(rows)} points'
    plot(rows, figure, kl_budgets=kl_budgets, title=title)
    relative = os.path.relpath(figure, os.path.dirname(os.path.abspath(doc))) if doc else figure
    text = markdown(rows, kl_budgets, command=command, figure=relative)
    files.atomic_write(os.path.join(out, 'frontier.md'), text.encode())
    if doc:
        replace_section(doc, text)
    if readme and os.path.isfile(readme) and SUMMARY_BEGIN in open(readme).read():
        figure_there = os.path.relpath(figure, os.path.dirname(os.path.abspath(readme)))
        first = kl_budgets[0]
        replace_section(readme, f'Made by `{command}` ({len(rows)} points). The gain at {first:g} nats, interpolated on '
                                f'each seed\'s frontier:\n\n{summary(rows, first)}\n![gain against KL]({figure_there})\n',
                        SUMMARY_BEGIN, SUMMARY_END)
    for budget in kl_budgets:
        for arm, entry in budget_table(rows, budget).items():
            seeds = ', '.join(_seed_cells(entry['seeds'], entry['seeds']))
            print(f'frontier: {arm} at {budget:g} nats: {_mean(entry)} (seeds: {seeds})')
    print(f'frontier: {len(rows)} points in {os.path.join(out, "frontier.jsonl")} and {os.path.join(out, "frontier.md")}'
          f'; the plot in {figure}' + (f'; the table in {doc}' if doc else ''))
    return rows


def replace_section(doc, text, begin=BEGIN, end=END):
    """doc with the text between its begin and end markers replaced (both added at its end when it has none)."""
    old = open(doc).read() if os.path.isfile(doc) else '# The reward–KL frontier\n'
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1]
    else:
        head, tail = old.rstrip('\n') + '\n\n', '\n'
    files.atomic_write(doc, (head + begin + '\n' + text + end + tail).encode())
