"""Ours: the frontier's table and plot, from its finished runs' frontier.json files alone (seconds, no model):

    <out>/frontier.jsonl     one row a point: arm, seed, knob, value, gain ± se, KL ± se (measured, or best-of-n's
                             bound), PPO's objective/kl, the reward model's accuracy on the initial policy's samples
                             and on the trained policy's, the command that made it
    <out>/frontier.md        the table in Markdown, and each arm's gain at each KL budget (default 6 nats, the
                             miniature's target, and 12, twice it) per seed, interpolated on that seed's frontier,
                             with their mean ± standard deviation over seeds
    figure                   gain against KL, one colour an arm: each seed's points (KL ± se: a bar; best-of-n's
                             bound: an open marker) and the mean over seeds of the seeds' interpolated frontiers (the
                             table's gains, ± their sd as a band) where every seed has points on both sides
    labels figure            where rows carry a label count: the gain at the first budget against it, an arm a curve
    doc                      the Markdown between the doc's markers replaced (the rest of the doc is kept)
"""

import itertools
import json
import os
import textwrap

import numpy as np

from lm_human_preferences.utils import files

BEGIN, END = '<!-- frontier table: begin (written by `launch.py frontier`) -->', '<!-- frontier table: end -->'
# The README's summary: the gain at the budget and the plot, between these markers where the README has them.
SUMMARY_BEGIN = '<!-- frontier summary: begin (written by `launch.py frontier`) -->'
SUMMARY_END = '<!-- frontier summary: end -->'
COLOURS = dict(ppo='C0', ppo_nofilter='C4', ppo_4x='C5', online='C1', best_of_n='C2', dpo='C3')
LABELS = dict(ppo='offline PPO (kl_coef)', ppo_nofilter='offline PPO without the filter (kl_coef)',
              ppo_4x='offline PPO, 4x the episodes (kl_coef)', online='online PPO, 3 retrains (kl_coef)',
              best_of_n="best-of-n by PPO's score (n; KL: the bound)", dpo="DPO, TRL, pairs by PPO's score (beta)")

# Best-of-n's and DPO's runs from before one objective (no 'objective' in their identity: sweep.py): best-of-n ranked
# by the reward model alone, DPO trained on every labelled pair. Their curves are their own, and say so.
EARLIER = dict(best_of_n='best-of-n by the reward model alone (n; KL: the bound)',
               dpo='DPO, TRL, every labelled pair (beta)')

# The arms, each one's knob, and the file that marks a run finished (written last by sweep.py, read here).
ARMS = ('ppo', 'ppo_nofilter', 'ppo_4x', 'online', 'best_of_n', 'dpo')
KNOBS = dict(ppo='kl_coef', ppo_nofilter='kl_coef', ppo_4x='kl_coef', online='kl_coef', best_of_n='n', dpo='beta')
DONE = 'frontier.json'
# An arm's variants (sweep.py's per-arm learning rate or label count): a run's identity may carry them, and a curve is
# an arm and the variant values its rows carry. Rows without them are the arm's own curve, keyed by its name alone.
VARIANTS = dict(lr='{:g}', labels='{:d}')


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


def earlier(row):
    """A best-of-n or DPO row from before one objective (EARLIER)."""
    return row['arm'] in EARLIER and row.get('objective') is None


def curve_key(row):
    """The curve a row belongs to: its arm, then each variant it carries ('ppo', 'dpo lr=0.001 labels=4096')."""
    return ' '.join([row['arm']] + [f'{name}={form.format(row[name])}' for name, form in VARIANTS.items()
                                    if row.get(name) is not None] + (['earlier'] if earlier(row) else []))


def curve_label(row):
    """The curve's name in tables and legends: the arm's label, then its variants ('…, lr 0.001', '…, 4,096
    labels')."""
    label = EARLIER[row['arm']] if earlier(row) else LABELS.get(row['arm'], f"{row['arm']} ({row['knob']})")
    if row.get('lr') is not None:
        label += f", lr {row['lr']:g}"
    if row.get('labels') is not None:
        label += f", {row['labels']:,} labels"
    return label


def curves(rows):
    """{curve key: its rows}, in the rows' order."""
    result = {}
    for r in rows:
        result.setdefault(curve_key(r), []).append(r)
    return result


def _by_seed(rows):
    """{seed: its rows} of one curve's rows, seeds ascending."""
    return {seed: [r for r in rows if r['seed'] == seed] for seed in sorted({r['seed'] for r in rows})}


def collect(out, arms=None):
    """Every point of the finished runs under out, as rows (sorted by arm, variant, seed, KL), each with the variant
    values (VARIANTS) its run's identity carries."""
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
            variant = {name: identity[name] for name in VARIANTS if identity.get(name) is not None}
            if identity.get('objective') is not None:
                variant['objective'] = identity['objective']
            for point in done['points']:
                rows.append(dict(arm=identity['arm'], seed=identity['seed'], knob=KNOBS[identity['arm']],
                                 **{**variant, **point}, command=done['command'],
                                 **{key: done[key] for key in ('seconds', 'runs_on') if key in done}))
    order = {arm: i for i, arm in enumerate(ARMS)}  # arms not in ARMS after them, by name
    return sorted(rows, key=lambda r: (order.get(r['arm'], len(ARMS)), r['arm'],
                                       *((r.get(name) is not None, r.get(name) or 0) for name in VARIANTS),
                                       r['seed'], r['kl']))


def gain_at(rows, kl, key='gain'):
    """The gain (or another of the points' values: `key`) at `kl` nats by linear interpolation between the two points
    around it on one seed's frontier of one arm; None when kl lies outside the points' KLs (no extrapolation) or a
    point has no such value."""
    kls, values = [r['kl'] for r in rows], [r[key] for r in rows]
    if not kls or kl < min(kls) or kl > max(kls) or None in values:
        return None
    order = np.argsort(kls)
    return float(np.interp(kl, np.array(kls)[order], np.array(values)[order]))


# A budget's bracket is tight when the seed's points on each side of it lie within this many nats of it.
BRACKET = 1.5


def wide_bracket(rows, kl):
    """Whether the points around `kl` on one seed's frontier lie more than BRACKET nats from it on either side (an
    interpolation across a gap: the table marks it); None when kl is outside the points."""
    kls = [r['kl'] for r in rows]
    if not kls or kl < min(kls) or kl > max(kls):
        return None
    below, above = max(k for k in kls if k <= kl), min(k for k in kls if k >= kl)
    return kl - below > BRACKET or above - kl > BRACKET


def own_samples_key(arm):
    """The reward model's accuracy on the arm's own samples: best-of-n's are the initial policy's samples."""
    return 'rm_initial' if arm == 'best_of_n' else 'rm_trained'


def budget_table(rows, budget):
    """{curve: {'seeds': {seed: gain or None}, 'mean': m, 'std': s, 'n': count, 'rm': {seed: accuracy or None}}} of
    the gain at `budget` nats and of the reward model's accuracy on the arm's own samples there; a curve is its
    curve_key (the arm's name for rows without variants)."""
    result = {}
    for key, mine in curves(rows).items():
        frontiers = _by_seed(mine)
        seeds = {seed: gain_at(frontier, budget) for seed, frontier in frontiers.items()}
        rm = {seed: gain_at(frontier, budget, own_samples_key(mine[0]['arm'])) for seed, frontier in frontiers.items()}
        wide = {seed: wide_bracket(frontier, budget) for seed, frontier in frontiers.items()}
        result[key] = dict(seeds=seeds, rm=rm, wide=wide, **spread(seeds.values()))
    return result


def mean_curve(frontiers, kl_budgets=(), num=200):
    """One curve's mean over seeds along KL, as the table takes it: (kls, means, sds or None) with each seed's gain
    interpolated on its own frontier (gain_at) and averaged (spread), at `num` KLs spaced evenly on the log axis the
    plot draws, every seed's point KLs and the budgets, all within the KLs every seed has points on both sides of
    (no extrapolation); None where the seeds' KL ranges share less than an interval. frontiers: {seed: rows}. At a
    budget it is the table's mean and sd exactly; between points a line on the log axis follows the interpolation."""
    low = max(min(r['kl'] for r in f) for f in frontiers.values())
    high = min(max(r['kl'] for r in f) for f in frontiers.values())
    if not low < high:
        return None
    grid = np.geomspace(low, high, num) if low > 0 else np.linspace(low, high, num)
    knots = [r['kl'] for f in frontiers.values() for r in f] + list(kl_budgets)
    kls = np.unique(np.concatenate([grid, [k for k in knots if low <= k <= high]]))
    spreads = [spread(gain_at(f, kl) for f in frontiers.values()) for kl in kls]
    sds = None if len(frontiers) < 2 else np.array([s['std'] for s in spreads])
    return kls, np.array([s['mean'] for s in spreads]), sds


def spread(values):
    """{'mean', 'std', 'n'} of the values that are not None (std: the sample standard deviation, None below two)."""
    values = [v for v in values if v is not None]
    return dict(n=len(values), mean=float(np.mean(values)) if values else None,
                std=float(np.std(values, ddof=1)) if len(values) > 1 else None)


def against(budgets, arm, baseline='ppo'):
    """The curve's gain at the budget less the baseline curve's, paired by seed: {'seeds': {seed: difference or None},
    'mean', 'std', 'n', 'above': seeds where the arm gains more}."""
    mine, theirs = budgets[arm]['seeds'], budgets[baseline]['seeds']
    seeds = {seed: (None if mine[seed] is None or theirs.get(seed) is None else mine[seed] - theirs[seed])
             for seed in mine}
    return dict(seeds=seeds, above=sum(d > 0 for d in seeds.values() if d is not None), **spread(seeds.values()))


def _seed_cells(values, seeds, wide=None):
    """A table row's per-seed cells of {seed: value or None}; † where `wide` marks the seed's bracket (wide_bracket)."""
    return ['–' if values.get(s) is None else f'{values[s]:+.2f}' + ('†' if (wide or {}).get(s) else '')
            for s in seeds]


def _mean(entry):
    """A spread's mean ± sd (the sd only with two values or more), or that the budget is out of its range."""
    if entry['mean'] is None:
        return 'out of its range'
    return f"{entry['mean']:+.2f}" + (f" ± {entry['std']:.2f}" if entry['std'] is not None else '')


def _mean_cell(entry):
    return _mean(entry) + ('' if entry['mean'] is None else f" ({entry['n']} seed{'s' if entry['n'] != 1 else ''})")


def summary(rows, budget, *, paired=True):
    """The findings at the budget, in Markdown: each curve's gain per seed and its mean ± sd, the reward model's
    accuracy on the arm's own samples, and (paired) each curve against offline PPO's of the same label count paired
    by seed (docs/frontier.md shows all; the README the first table)."""
    budgets, first = budget_table(rows, budget), {key: mine[0] for key, mine in curves(rows).items()}
    seeds = sorted({r['seed'] for r in rows})
    lines = ['| arm (knob) | ' + ' | '.join(f'seed {s}' for s in seeds) + ' | mean ± sd | RM on its own samples |',
             '|---|' + '---|' * (len(seeds) + 2)]
    for key, entry in budgets.items():
        cells = _seed_cells(entry['seeds'], seeds, entry['wide'])
        rm = spread(entry['rm'].values())
        rm_cell = '–' if rm['mean'] is None else f"{100 * rm['mean']:.1f} %" + (
            f" ± {100 * rm['std']:.1f}" if rm['std'] is not None else '')
        lines.append(f'| {curve_label(first[key])} | ' + ' | '.join(cells) + f' | {_mean_cell(entry)} | {rm_cell} |')
    if any(any(entry['wide'].values()) for entry in budgets.values()):
        lines += ['', f'† the seed\'s points around {budget:g} nats lie more than {BRACKET:g} nats from it on a side: '
                      f'its gain there is interpolated across that gap.']
    baselines = {key: curve_key(dict(row, arm='ppo', lr=None)) for key, row in first.items()}
    against_ppo = [key for key in budgets if paired and baselines[key] in budgets and baselines[key] != key]
    if against_ppo:
        lines += ['', f'Against offline PPO at {budget:g} nats, paired by seed (the arm\'s gain less offline PPO\'s on the '
                      f'same seed\'s initial model and labels):', '',
                  '| arm | ' + ' | '.join(f'seed {s}' for s in seeds) + ' | mean ± sd | seeds where it gains more |',
                  '|---|' + '---|' * (len(seeds) + 2)]
        for key in against_ppo:
            entry = against(budgets, key, baselines[key])
            cells = _seed_cells(entry['seeds'], seeds)
            lines.append(f'| {curve_label(first[key])} | ' + ' | '.join(cells) + f' | {_mean_cell(entry)} | '
                         f"{entry['above']} of {entry['n']} |")
    return '\n'.join(lines) + '\n'


def labelled(rows, default_labels=None):
    """The rows on the label axis: those that carry `labels`, and where default_labels is given (the experiment's
    labels.num_train: sweep.py names no run by the default count) the rows without it of the same arms, at it."""
    arms = {r['arm'] for r in rows if r.get('labels') is not None}
    return [r if r.get('labels') is not None else dict(r, labels=default_labels) for r in rows
            if r.get('labels') is not None or (default_labels is not None and r['arm'] in arms)]


def label_table(rows, budget=6.0, default_labels=None):
    """{curve without its label count: {labels: budget_table's entry there}} of the labelled rows, counts ascending:
    each arm's gain at `budget` nats against the number of labels, mean ± sd over seeds."""
    labelled_rows = labelled(rows, default_labels)
    budgets = budget_table(labelled_rows, budget)
    result = {}
    for key, mine in curves(labelled_rows).items():
        result.setdefault(curve_key(dict(mine[0], labels=None)), {})[mine[0]['labels']] = budgets[key]
    return {key: dict(sorted(entries.items())) for key, entries in result.items()}


def _label_curves(rows):
    """{curve without its label count: its first row without it} of labelled rows."""
    return {key: mine[0] for key, mine in curves([dict(r, labels=None) for r in rows]).items()}


def labels_needed(entries, target):
    """The fewest labels whose mean gain reaches `target`, of one curve's label_table entries: interpolated on
    log(labels) between the largest count below the target and the next (the first crossing, counts ascending); the
    smallest count itself when it already reaches it (fewer were not run); None when no count reaches it."""
    points = [(count, entry['mean']) for count, entry in sorted(entries.items()) if entry['mean'] is not None]
    for i, (count, mean) in enumerate(points):
        if mean >= target:
            if i == 0:
                return float(count)
            below, below_mean = points[i - 1]
            share = (target - below_mean) / (mean - below_mean)
            return float(np.exp(np.log(below) + share * (np.log(count) - np.log(below))))
    return None


def labels_summary(rows, budget, targets=(1.0, 1.5), default_labels=None):
    """The gain at the budget against the number of labels, in Markdown: a row a curve, a column a label count (mean
    ± sd over seeds), then the labels it needs to reach each target gain (labels_needed)."""
    entries_of = label_table(rows, budget, default_labels)
    first = _label_curves(labelled(rows, default_labels))
    counts = sorted({count for entries in entries_of.values() for count in entries})
    lines = ['| arm (knob) | ' + ' | '.join(f'{count:,} labels' for count in counts) + ' | '
             + ' | '.join(f'labels to reach {target:+g}' for target in targets) + ' |',
             '|---|' + '---|' * (len(counts) + len(targets))]
    for key, entries in entries_of.items():
        cells = ['–' if count not in entries else _mean_cell(entries[count]) for count in counts]
        for target in targets:
            needed = labels_needed(entries, target)
            smallest = needed is not None and needed == min(c for c, e in entries.items() if e['mean'] is not None)
            cells.append('not reached' if needed is None else ('≤ ' if smallest else '') + f'{needed:,.0f}')
        lines.append(f'| {curve_label(first[key])} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def markdown(rows, kl_budgets, *, command, figure=None, labels_figure=None, default_labels=None):
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
    if any(r.get('labels') is not None for r in rows):
        for i, budget in enumerate(kl_budgets):
            lines += [f'### Gain at {budget:g} nats against the number of labels', '',
                      f'Each label count\'s gain at {budget:g} nats as above, mean ± sd over seeds; the labels a '
                      f'curve needs to reach a gain: interpolated on log(labels) between the two counts around it (≤: '
                      f'its smallest count reaches it).', '']
            if labels_figure and i == 0:
                lines += [f'![gain against labels]({labels_figure})', '']
            lines += [labels_summary(rows, budget, default_labels=default_labels).rstrip('\n'), '']
    cpus = sorted({r['runs_on'] for r in rows if r.get('runs_on')})
    lines += ['### Every point', '']
    if cpus:  # each run's compute: samples drawn (beyond the labels' own), optimizer steps, its time, where
        lines += ['Compute: the samples a run drew beyond its labels\' own and its optimizer steps (a best-of-n point: '
                  'its n × its queries), and the run\'s wall time (best-of-n: every n at once), on '
                  + '; '.join(f'({i}) {cpu}' for i, cpu in enumerate(cpus, 1)) + '.', '']
    lines += ['| arm | seed | knob | gain ± se | KL (nats) | PPO objective/kl | RM: initial → trained samples | '
              'compute | command |', '|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        kl = f"{r['kl']:.2f} ± {r['kl_se']:.2f}" if r['kl_kind'] == 'measured' else f"≤ {r['kl']:.2f} (bound)"
        objective = '–' if r['kl_objective'] is None else f"{r['kl_objective']:.2f}"
        compute = '–' if r.get('samples') is None else (
            f"{r['samples']:,} samples, {r['optimizer_steps']:,} steps"
            + (f", {minutes(r['seconds'])}" if r.get('seconds') is not None else '')
            + (f" ({cpus.index(r['runs_on']) + 1})" if r.get('runs_on') in cpus else ''))
        lines.append(f"| {curve_key(r)} | {r['seed']} | {r['knob']} {r['value']:g} | {r['gain']:+.2f} ± "
                     f"{r['gain_se']:.2f} | {kl} | {objective} | {_pct(r['rm_initial'])} → {_pct(r['rm_trained'])} | "
                     f"{compute} | `{r['command']}` |")
    return '\n'.join(lines) + '\n'


MARKERS = 'osD^vP*X'  # a seed's marker, by its place among the rows' seeds
# A curve's line: an arm's variants in turn (the budgets' lines are grey dots).
LINESTYLES = ('-', '--', '-.', (0, (5, 1, 1, 1, 1, 1)))


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def styles(rows):
    """{curve key: (colour, line style)}: an arm's colour (COLOURS; an arm not in it the next colour of matplotlib's
    cycle none has), its variants' curves from darker to lighter shades of it and each its own line style; an arm
    without variants its colour and a solid line."""
    from matplotlib.colors import to_rgb
    spare = itertools.cycle([f'C{i}' for i in range(10) if f'C{i}' not in COLOURS.values()])
    by_arm = {}
    for key, mine in curves(rows).items():
        by_arm.setdefault(mine[0]['arm'], []).append(key)
    result = {}
    for arm, keys in by_arm.items():
        base = np.array(to_rgb(COLOURS[arm] if arm in COLOURS else next(spare)))
        for i, key in enumerate(keys):
            shade = 0.0 if len(keys) == 1 else 0.8 * (i / (len(keys) - 1) - 0.5)  # -0.4 (darker) to 0.4 (lighter)
            rgb = base * (1 + shade) if shade < 0 else base + (1 - base) * shade
            result[key] = (tuple(float(c) for c in rgb), LINESTYLES[i % len(LINESTYLES)])
    return result


def _save(fig, path):
    """The figure written whole then moved to path; without the PNG's Software field (matplotlib's version) and with
    no timestamp, so the same rows give the same bytes."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f'{path}.tmp-{os.getpid()}.png'
    fig.savefig(tmp, dpi=110, metadata={'Software': None})
    _pyplot().close(fig)
    os.replace(tmp, path)


def plot(rows, path, *, kl_budgets, title):
    """Gain against KL: each seed's points (marker by seed; ± se bars on the gain and on the KL, best-of-n's bound an
    open marker), each curve's mean over seeds as the table takes it (mean_curve) ± its sd over seeds as a band, the
    budgets marked and labeled."""
    plt = _pyplot()
    import matplotlib.ticker
    import matplotlib.transforms
    fig, ax = plt.subplots(figsize=(8, 5.5))
    seeds = sorted({r['seed'] for r in rows})
    style = styles(rows)
    for key, mine in curves(rows).items():
        colour, line = style[key]
        frontiers = _by_seed(mine)
        for seed, points in frontiers.items():
            for bound in (False, True):
                these = [r for r in points if (r['kl_kind'] == 'bound') == bound]
                if these:
                    ax.errorbar([r['kl'] for r in these], [r['gain'] for r in these],
                                yerr=[r['gain_se'] for r in these], xerr=[r['kl_se'] for r in these],
                                fmt=MARKERS[seeds.index(seed) % len(MARKERS)], color=colour,
                                mfc='none' if bound else colour, alpha=0.45, ms=5, capsize=2, lw=1)
        curve = mean_curve(frontiers, kl_budgets)
        kls, means, sds = curve if curve is not None else ([], [], None)
        ax.plot(kls, means, ls=line, color=colour, lw=2, label=curve_label(mine[0]))
        if sds is not None:
            ax.fill_between(kls, means - sds, means + sds, color=colour, alpha=0.12, lw=0)
    for i, seed in enumerate(seeds):
        ax.plot([], [], MARKERS[i % len(MARKERS)], color='grey', label=f'seed {seed}')
    if any(r['kl_kind'] == 'bound' for r in rows):
        ax.plot([], [], 'o', mfc='none', color='grey', label='open marker: KL its bound (the KL lies left of it)')
    at_bottom = matplotlib.transforms.blended_transform_factory(ax.transData, ax.transAxes)
    for budget in kl_budgets:
        ax.axvline(budget, color='grey', ls=':', lw=1)
        ax.text(budget, 0.02, f'{budget:g} nats', transform=at_bottom, rotation=90, ha='center', va='bottom',
                fontsize=8, color='dimgrey', zorder=5, bbox=dict(fc='white', ec='none', alpha=0.8, pad=1))
    # A log axis: the knobs span 2 to 10 nats, but a run can land far past them (online PPO at a small kl_coef: 38
    # nats), which on a linear axis squeezes every other point into its left third. symlog only if a KL is <= 0.
    kls = [r['kl'] for r in rows]
    ax.set_xscale('log' if min(kls) > 0 else 'symlog')
    ticks = [m * 10.0 ** e for e in range(-2, 4) for m in (1, 2, 5) if min(kls) / 2 <= m * 10.0 ** e <= max(kls) * 2]
    ax.set_xticks(ticks, [f'{t:g}' for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel('KL(π ‖ ρ), nats a response (log scale)')
    ax.set_ylabel("VADER gain, sd of the initial policy's scores")
    ax.set_title(textwrap.fill(title, 100), fontsize=10)  # a long --arms list: wrapped, not cut off
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='best')
    _save(fig, path)


def plot_labels(rows, path, budget=6.0, *, title='', default_labels=None):
    """The gain at the budget against the number of labels (log axis), a curve an arm (and learning rate): each seed's
    gain (marker by seed) and the mean ± sd over seeds (label_table; default_labels as there)."""
    plt = _pyplot()
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seeds = sorted({r['seed'] for r in rows})
    first = _label_curves(labelled(rows, default_labels))
    style = styles(list(first.values()))
    for key, entries in label_table(rows, budget, default_labels).items():
        colour, line = style[key]
        counts = [count for count, entry in entries.items() if entry['mean'] is not None]
        for seed in seeds:
            mine = [(count, entries[count]['seeds'].get(seed)) for count in counts]
            mine = [(count, gain) for count, gain in mine if gain is not None]
            ax.plot([c for c, _ in mine], [g for _, g in mine], MARKERS[seeds.index(seed) % len(MARKERS)],
                    color=colour, alpha=0.45, ms=5)
        ax.errorbar(counts, [entries[c]['mean'] for c in counts], yerr=[entries[c]['std'] or 0 for c in counts],
                    ls=line, marker='_', ms=10, color=colour, lw=2, capsize=3, label=curve_label(first[key]))
    for i, seed in enumerate(seeds):
        ax.plot([], [], MARKERS[i % len(MARKERS)], color='grey', label=f'seed {seed}')
    counts = sorted({r['labels'] for r in labelled(rows, default_labels)})
    ax.set_xscale('log')
    ax.set_xticks(counts, [f'{count:,}' for count in counts])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel('labels (log scale)')
    ax.set_ylabel(f"VADER gain at {budget:g} nats, sd of the\ninitial policy's scores (mean ± sd over seeds)")
    ax.set_title(textwrap.fill(title, 100), fontsize=10)  # a long --arms list: wrapped, not cut off
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='best')
    _save(fig, path)


def write(out, *, arms, kl_budgets, command, figure, doc, readme=None, default_labels=None):
    """The table (frontier.jsonl, frontier.md under out), the figure, the doc's table and the readme's summary
    (where it has the SUMMARY markers: the first budget's) from the finished runs; where rows carry a label count,
    the gain against it (<figure>_labels.png: the first budget's, and a section a budget; default_labels: the count
    of the rows without one, as in labelled); returns the rows."""
    rows = collect(out, arms)
    if not rows:
        print(f'frontier: no finished run in {out} yet: nothing to tabulate')
        return rows
    files.atomic_write(os.path.join(out, 'frontier.jsonl'), ''.join(json.dumps(r) + '\n' for r in rows).encode())
    title = f'{command}: {len(rows)} points'
    plot(rows, figure, kl_budgets=kl_budgets, title=title)
    labels_figure = None
    if any(r.get('labels') is not None for r in rows):
        labels_figure = f'{os.path.splitext(figure)[0]}_labels.png'
        plot_labels(rows, labels_figure, kl_budgets[0], title=title, default_labels=default_labels)

    def text(where):
        """The Markdown, its figures linked from the folder `where` (out's frontier.md, or the doc's)."""
        def relative(path):
            return os.path.relpath(os.path.abspath(path), os.path.abspath(where)) if path else path
        return markdown(rows, kl_budgets, command=command, figure=relative(figure),
                        labels_figure=relative(labels_figure), default_labels=default_labels)

    files.atomic_write(os.path.join(out, 'frontier.md'), text(out).encode())
    if doc:
        replace_section(doc, text(os.path.dirname(os.path.abspath(doc))))
    if readme and os.path.isfile(readme) and SUMMARY_BEGIN in open(readme).read():
        figure_there = os.path.relpath(figure, os.path.dirname(os.path.abspath(readme)))
        first = kl_budgets[0]
        replace_section(readme, f'Made by `{command}` ({len(rows)} points). The gain at {first:g} nats, interpolated on '
                                f'each seed\'s frontier (each arm against offline PPO, paired by seed: the doc):\n\n'
                                f'{summary(rows, first, paired=False)}\n![gain against KL]({figure_there})\n',
                        SUMMARY_BEGIN, SUMMARY_END)
    for budget in kl_budgets:
        for arm, entry in budget_table(rows, budget).items():
            seeds = ', '.join(_seed_cells(entry['seeds'], entry['seeds']))
            print(f'frontier: {arm} at {budget:g} nats: {_mean(entry)} (seeds: {seeds})')
    print(f'frontier: {len(rows)} points in {os.path.join(out, "frontier.jsonl")} and {os.path.join(out, "frontier.md")}'
          f'; the plot in {figure}' + (f' and {labels_figure}' if labels_figure else '')
          + (f'; the table in {doc}' if doc else ''))
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
