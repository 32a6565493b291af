"""Ours: the frontier's runs (`python launch.py frontier EXP`), each in a folder of its own under --out:

    <out>/seed<S>/reward/            the seed's reward model: `launch.py train_reward EXP reward --run.seed S`
                                     (the seed's cached initial model and labels: offline/experiment.py)
    <out>/seed<S>/reward-labels<N>/  the same on the first N training labels (labels-<N>.json: those and the same
                                     held-out labels), for the label axis (--labels)
    <out>/seed<S>/baseline/          the initial policy's scores on the test queries: every arm's gain is against them
    <out>/seed<S>/ppo-kl_coef<C>/    `launch.py train_policy EXP ... --rewards.trained_model <that reward model>
                                     --rewards.train_new_model off --rewards.adaptive_kl off --rewards.kl_coef C`
    <out>/seed<S>/ppo_nofilter-.../  the same with --task.filter_responses off (every response scored by the model)
    <out>/seed<S>/ppo_4x-.../        the same with 4 times the episodes
    <out>/seed<S>/online-kl_coef<C>/ `launch.py train_policy EXP ... --online.retrains 3` on the same labels budget
    <out>/seed<S>/best_of_n/         every n at once (the first n samples of the largest n)
    <out>/seed<S>/best_of_n_samples/ those samples, drawn once a seed: each label count's reward model ranks them
    <out>/seed<S>/initial_hf/        the seed's initial model as a Hugging Face folder, for DPO
    <out>/seed<S>/dpo-beta<B>/       TRL's DPOTrainer (trl/: its checkpoints; policy_hf/: the trained model)
A run of another learning rate or label count than the arm's default has -lr<R> / -labels<N> after its knob's value.

A run is finished when its frontier.json is there (written atomically, last: its points and the command that made
it). A rerun of the sweep skips the finished runs, and a run stopped midway (a kill -9, the end of a session) is
resumed, not started again: the trainers resume from their save dirs, DPOTrainer from its last checkpoint. The
table and the plot are made from the frontier.json files alone (table.py).

One objective for every arm: the score PPO maximizes (train_policy.make_score_fn: the reward model's score, or the
task's penalty_reward_value for a response that fails its truncation filter). Best-of-n picks by it (evaluate.py), DPO's
pairs follow it (dpo.objective_pair); ppo_nofilter shows what the filter costs PPO.
"""

import dataclasses
import glob
import hashlib
import json
import os
import shlex
import time

from lm_human_preferences.frontier import table
from lm_human_preferences.frontier.table import ARMS, DONE, KNOBS
from lm_human_preferences.utils import files
from lm_human_preferences.utils.command_line import ConfigError

# Chosen so that every arm has a point within 1.5 nats of 6 and of 12 on each side on every seed (table.BRACKET), from
# where each landed on seeds 1-3 (docs/frontier.md). For PPO a fixed kl_coef (in 44 batches the adaptive controller
# moves kl_coef too little, or too late, for its target to set the KL: docs/sentiment_mini.md): offline 0.25-0.17 at
# 4.0-9.1 nats, 0.13-0.07 at 10.1-16.6; online lands further at the same kl_coef (0.3 at 1.5-4.4, 0.21 at 8.6-10.0,
# 0.15 at 15-38), so 0.25 and 0.17 between. Without the filter, or with 4x the episodes, PPO lands further: 0.3 keeps
# a point below 6. Best-of-n up to 2,048 samples, whose bound is 6.63 nats (it reaches 10.5 nats at ~99,000 samples a
# query: 12 is out of its range). DPO on every pair landed at 2.1-2.5 (beta 1) to 15.3-18.3 (0.1); on PPO's objective
# (its pairs ordered by the filter) beta 0.4 went to 16.05 nats on seed 1, so with KL ~ beta^-0.87 as before: 2, 1.2,
# 0.8, 0.55 and 0.4 for about 3.5, 6, 8.5, 12 and 16 nats.
DEFAULT_POINTS = dict(ppo=(0.3, 0.25, 0.21, 0.17, 0.13, 0.1, 0.07), ppo_nofilter=(0.3, 0.21, 0.13, 0.1, 0.07),
                      ppo_4x=(0.3, 0.21, 0.13, 0.1, 0.07), online=(0.4, 0.3, 0.25, 0.21, 0.17, 0.15),
                      best_of_n=(4, 16, 64, 256, 1024, 2048), dpo=(2, 1.2, 0.8, 0.55, 0.4))
ONLINE_RETRAINS = 3
REWARD_PREFIX = 'rewards.train_new_model.'  # the reward model's hparams, as train_policy names them
PPO_ARMS = ('ppo', 'ppo_nofilter', 'ppo_4x')  # offline PPO against the seed's reward model
# The arms a learning rate (--lr) and a label count (--labels) apply to; the online arm's labels come in rounds.
LR_ARMS = (*PPO_ARMS, 'online', 'dpo')
LABEL_ARMS = (*PPO_ARMS, 'best_of_n', 'dpo')
# A seed's training labels (labels.num_train; the label axis takes the first N of them) where the frontier keeps
# another count than the experiment binds: the miniature's own run trains on 8,192 (docs/sentiment_mini.md), its
# frontier on the 16,384 its runs were made on, so that a stored run is what its frontier command makes.
# --rewards.train_new_model.labels.num_train sets another.
NUM_TRAIN = dict(sentiment_mini=16384)
# A run's time on two cores of an AMD EPYC Zen 4 (each arm's measured seconds, docs/frontier.md), for the plan's line
# before any run of the arm has finished in --out: PPO 2.5 min, 4x the episodes 10; online 17; best-of-n on 1,024
# queries (512k samples) ~35; DPO on PPO's objective (about half the pairs kept) ~26; a seed's first reward model
# (its initial model, labels) ~15, one on a prefix of its labels ~2.
# A best-of-n run that ranks its seed's kept samples by another reward model takes this share of one that draws them
# (sentiment_mini on one core: 1.2 s to score a column of 1,024 samples against 5.5 s to draw, label and score it).
BEST_OF_N_RANKING_SHARE = 0.2
ESTIMATED_SECONDS = dict(ppo=150, ppo_nofilter=150, ppo_4x=600, online=1020, best_of_n=2100, dpo=1560, reward=900)
ATTEMPTS = 'frontier_attempts.json'  # a run's processes' starts and ends, so that a resumed run's time is summed


def parse_list(option, value, parse, allowed=None):
    """A comma-separated option ('1,2,3') as a list, one line naming the option when it is not one."""
    items = [v.strip() for v in str(value).split(',') if v.strip()]
    try:
        parsed = [parse(v) for v in items]
    except ValueError:
        raise ConfigError(f'--{option} {value}: a comma-separated list of {parse.__name__}s') from None
    if not parsed:
        raise ConfigError(f'--{option} is empty')
    if allowed is not None and set(parsed) - set(allowed):
        raise ConfigError(f"--{option} {value}: {', '.join(sorted(set(parsed) - set(allowed)))} is not an arm "
                          f"(choose from: {', '.join(allowed)})")
    if len(set(parsed)) != len(parsed):
        raise ConfigError(f'--{option} {value}: a value is given twice')
    return parsed


def _arm_parts(option, value, arms, allowed, form):
    """(arm, its values' text) of each part of --option 'ARM=V1,V2;ARM=...', one line naming the option when a part
    is not of that form (form: 'V1,V2' or the like, as the line shows it) or its arm is not in --arms."""
    for part in (value or '').split(';'):
        if not part.strip():
            continue
        arm, _, values = part.partition('=')
        arm = arm.strip()
        if arm not in allowed or not values:
            raise ConfigError(f"--{option} {value}: each part is ARM={form},... with ARM one of {', '.join(allowed)}")
        if arm not in arms:
            raise ConfigError(f'--{option} {value}: {arm} is not in --arms')
        yield arm, values


def parse_points(value, arms):
    """--points 'ppo=2,6,10;dpo=0.1,0.03': the knob's values of the arms named (the others keep DEFAULT_POINTS)."""
    points = {arm: list(DEFAULT_POINTS[arm]) for arm in arms}
    for arm, values in _arm_parts('points', value, arms, ARMS, 'V1,V2'):
        parse = int if arm == 'best_of_n' else float
        points[arm] = parse_list(f'points {arm}', values, parse)
        if not all(v > 0 for v in points[arm]) or (arm == 'best_of_n' and any(v & (v - 1) for v in points[arm])):
            raise ConfigError(f'--points {arm}={values}: {KNOBS[arm]} must be positive'
                              + (' powers of 2' if arm == 'best_of_n' else ''))
    return points


def parse_lr(value, arms):
    """--lr 'ppo=3e-4,6e-4;dpo=1e-4,3e-4': each named arm's learning rates (the others: the arm's default alone)."""
    rates = {}
    for arm, values in _arm_parts('lr', value, arms, LR_ARMS, 'R1,R2'):
        try:
            rates[arm] = parse_list('lr', values, float)
        except ConfigError as e:
            raise ConfigError(f'--lr {value}: {str(e).split(": ", 1)[1]}') from None
        if not all(r > 0 for r in rates[arm]):
            raise ConfigError(f'--lr {arm}={values}: learning rates must be positive')
    return rates


@dataclasses.dataclass(frozen=True)
class Planned:
    """One run of the sweep: an arm at a knob's value (None: best-of-n's every n) on a seed; lr and labels None at the
    arm's defaults (the run's name and identity then as before they existed)."""
    arm: str
    seed: int
    value: object
    lr: object = None
    labels: object = None


class Sweep:
    """The runs of one frontier, in order, each done once (see the module's docstring). exp: the OfflineExperiment
    (the launcher's, offline_experiments.py); train_policy / train_reward: launch.py's commands (called as the command
    line calls them); bound: the experiment's train_policy bindings
    {key: value}; extra: the command line's hparams, for every run (train_policy's names)."""

    def __init__(self, exp, out, *, arms, seeds, points, train_policy, train_reward, bound, extra,
                 best_of_n_queries, dpo_options, lrs=None, labels=None):
        from lm_human_preferences.frontier import dpo
        self.exp, self.exp_name, self.out, self.arms, self.seeds, self.points = exp, exp.name, out, arms, seeds, points
        self.train_policy_command, self.train_reward_command = train_policy, train_reward
        self.extra, self.bound = dict(extra), bound
        self.best_of_n_queries, self.dpo_options = best_of_n_queries, dpo_options
        self.num_train = num_train = labels_num_train(exp.name, extra, bound)
        batch = int(self.extra.get(REWARD_PREFIX + 'batch_size', bound[REWARD_PREFIX + 'batch_size']))
        if 'online' in arms and (num_train % (4 * batch)):
            raise ConfigError(f'the online arm trains on a quarter of labels.num_train ({num_train}) first: it must be '
                              f'a multiple of 4 x the reward batch_size ({batch})')
        # Each arm's default rate, which names no run: PPO's from the experiment (or the command line), DPO's.
        self.default_lr = {arm: float(self.policy_bound('ppo.lr')) for arm in (*PPO_ARMS, 'online')}
        self.default_lr['dpo'] = dpo.LEARNING_RATE
        self.lrs = {arm: [None if r == self.default_lr[arm] else r for r in rates]
                    for arm, rates in (lrs or {}).items()}
        labels = list(labels or [num_train])
        for n in labels:
            if n > num_train or n % batch:
                raise ConfigError(f'--labels {",".join(map(str, labels))}: each count at most labels.num_train '
                                  f'({num_train}) and a multiple of the reward batch_size ({batch})')
        self.labels = [None if n == num_train else n for n in labels]
        if 'dpo' in arms:
            dpo.check_installed()

    # ---- the plan
    def runs(self):
        """The Planned runs, in the order they run: arm by arm (the cheapest first), label count by label count (the
        fewest first), learning rate by rate, value by value, seed by seed, so that a partial sweep already holds every
        seed of the first points; best-of-n is one run a seed (all its n)."""
        order = [arm for arm in ('ppo', 'ppo_nofilter', 'best_of_n', 'ppo_4x', 'online', 'dpo') if arm in self.arms]
        plan = []
        for arm in order:
            values = [None] if arm == 'best_of_n' else self.points[arm]
            counts = (sorted(self.labels, key=lambda n: self.num_train if n is None else n) if arm in LABEL_ARMS
                      else [None])
            plan += [Planned(arm, seed, value, lr, labels) for labels in counts for lr in self.lrs.get(arm, [None])
                     for value in values for seed in self.seeds]
        return plan

    def seed_dir(self, seed):
        return os.path.join(self.out, f'seed{seed}')

    def run_name(self, run):
        return (run.arm if run.value is None else f'{run.arm}-{KNOBS[run.arm]}{run.value:g}') + (
            '' if run.lr is None else f'-lr{run.lr:g}') + ('' if run.labels is None else f'-labels{run.labels}')

    def reward_dir(self, seed, labels=None):
        return os.path.join(self.seed_dir(seed), 'reward' if labels is None else f'reward-labels{labels}')

    # ---- the sweep
    def run_all(self):
        plan = self.runs()
        started = time.time()
        print(self.plan_line(plan), flush=True)
        for i, run in enumerate(plan, 1):
            run_dir = os.path.join(self.seed_dir(run.seed), self.run_name(run))
            what = (f'[frontier {i}/{len(plan)}] {run.arm} seed {run.seed}'
                    + ('' if run.value is None else f' {KNOBS[run.arm]} {run.value:g}')
                    + ('' if run.lr is None else f' lr {run.lr:g}')
                    + ('' if run.labels is None else f' {run.labels} labels'))
            done = read_done(run_dir)
            if done is None:
                this_start = start_attempt(run_dir)
                done = self.run(run, run_dir)
                done['seconds'] = attempts_seconds(run_dir, this_start)
                files.atomic_write(os.path.join(run_dir, DONE), json.dumps(done, indent=2).encode())
                when = f'{table.minutes(done["seconds"])}'
            else:
                self.check_same(done, run, run_dir)
                when = 'done earlier'
            print(f'{what}: {table.points_line(done["points"])} ({when}; {run_dir})', flush=True)
        print(f'frontier: {len(plan)} runs in {self.out}, {table.minutes(time.time() - started)} this time', flush=True)

    def plan_line(self, plan):
        """What the sweep will run, before it starts: its runs, those finished earlier, and the time the rest take at
        each arm's mean time a run of the runs finished in this --out (else ESTIMATED_SECONDS), with the seeds' reward
        models."""
        done = {run: read_done(os.path.join(self.seed_dir(run.seed), self.run_name(run))) for run in plan}
        measured = {}  # every finished run in --out, this plan's or not: seconds a run at the full label count
        for seed_dir in glob.glob(os.path.join(self.out, 'seed*')):
            for path in glob.glob(os.path.join(seed_dir, '*', DONE)):
                with open(path) as f:
                    finished = json.load(f)
                identity = finished.get('identity', {})
                if 'seconds' in finished and identity.get('arm') in ARMS:
                    share = self.label_share(Planned(identity['arm'], identity['seed'], identity.get('value'),
                                                     labels=identity.get('labels')),
                                             draws=finished.get('drew_samples', True))
                    measured.setdefault(identity['arm'], []).append(finished['seconds'] / share)
        drawn = {seed for seed in self.seeds if self.best_of_n_samples_kept(seed)}
        seconds = 0.0
        for run, finished in done.items():
            if finished is None:
                share = self.label_share(run, draws=run.seed not in drawn)
                seconds += share * (sum(measured[run.arm]) / len(measured[run.arm]) if run.arm in measured
                                    else ESTIMATED_SECONDS[run.arm])
                if run.arm == 'best_of_n':
                    drawn.add(run.seed)  # the seed's later best-of-n runs rank what this one draws
        rewards = {(run.seed, run.labels) for run, finished in done.items() if finished is None and run.arm != 'online'
                   and read_done(self.reward_dir(run.seed, run.labels)) is None}
        seconds += len(rewards) * ESTIMATED_SECONDS['reward']
        finished = sum(d is not None for d in done.values())
        return (f'frontier: {len(plan)} runs, {finished} finished earlier; the rest about {seconds / 3600:.1f} h '
                f'(with {len(rewards)} reward models; at the mean time of each arm\'s finished runs here, else on two '
                f'cores of an AMD EPYC Zen 4: frontier/sweep.py ESTIMATED_SECONDS)')

    def label_share(self, run, draws=True):
        """A run's time against its arm's run at the full label count: the same (DPO's takes the full count's steps),
        but best-of-n's when it ranks the samples a run of its seed drew earlier (not `draws`):
        BEST_OF_N_RANKING_SHARE."""
        return BEST_OF_N_RANKING_SHARE if run.arm == 'best_of_n' and not draws else 1.0

    def check_same(self, done, run, run_dir):
        """A finished run of other settings (another experiment, hparams or labels budget) is not this sweep's."""
        expected = self.identity(run)
        if done.get('identity') != expected:
            raise ValueError(f'{os.path.join(run_dir, DONE)} is a run of other settings ({done.get("identity")}, this '
                             f'sweep: {expected}): give this sweep another --out, or remove that run')

    def identity(self, run):
        return dict(experiment=self.exp_name, arm=run.arm, seed=run.seed, value=run.value, hparams=self.extra,
                    **({} if run.lr is None else {'lr': run.lr}),
                    **({} if run.labels is None else {'labels': run.labels}),
                    # best-of-n and DPO on PPO's objective (the filter's penalty): runs before it are not comparable
                    **({'best_of_n_queries': self.best_of_n_queries, 'objective': 'ppo_score'}
                       if run.arm == 'best_of_n' else {}),
                    **({'dpo': self.dpo_options, 'objective': 'ppo_score'} if run.arm == 'dpo' else {}))

    def run(self, run, run_dir):
        if run.arm != 'online':
            self.ensure_reward_model(run.seed, run.labels)
        baseline = self.ensure_baseline(run.seed)
        draws = run.arm == 'best_of_n' and not self.best_of_n_samples_kept(run.seed)
        command, points = getattr(self, f'run_{"ppo" if run.arm in PPO_ARMS else run.arm}')(run, run_dir, baseline)
        for point in points:  # (its lr and labels: the identity's, which the table reads)
            point.update(baseline_mean=baseline['mean'], baseline_std=baseline['std'])
        return dict(identity=self.identity(run), command=self.frontier_line(run), trainer_command=command,
                    runs_on=runs_on(), points=points, **({'drew_samples': draws} if run.arm == 'best_of_n' else {}))

    def frontier_line(self, run):
        """The command that makes this run again, from the repository (its --out when that lies inside it; else the
        default's), with the seed's reward model and baseline."""
        knob = '' if run.value is None else f" --points '{run.arm}={run.value:g}'"
        if run.arm == 'best_of_n':
            knob = f" --points 'best_of_n={','.join(str(n) for n in self.points['best_of_n'])}'"
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = os.path.relpath(self.out, repo)
        return (f'python launch.py frontier {self.exp_name} --arms {run.arm} --seeds {run.seed}{knob}'
                + ('' if run.lr is None else f" --lr '{run.arm}={run.lr:g}'")
                + ('' if run.labels is None else f' --labels {run.labels}')
                + (f' --best_of_n_queries {self.best_of_n_queries}' if run.arm == 'best_of_n' else '')
                + ''.join(f' --{k} {shlex.quote(str(v))}' for k, v in self.extra.items())
                + ('' if out.startswith('..') else f' --out {shlex.quote(out)}'))

    # ---- the seed's reward model and baseline
    def ensure_reward_model(self, seed, labels=None):
        """The seed's reward model (on its first `labels` training labels, when given), trained once; a finished one
        is reused only if it was made with this sweep's hparams, from the labels and initial model it was made from
        (else one line says which differs and nothing runs)."""
        if labels is not None:
            self.ensure_reward_model(seed)  # makes the seed's labels
        reward_dir = self.reward_dir(seed, labels)
        hparams = {k[len(REWARD_PREFIX):]: v for k, v in self.extra.items() if k.startswith(REWARD_PREFIX)}
        hparams['run.seed'] = str(seed)
        if labels is not None:
            hparams.update({'labels.source': self.label_prefix_file(seed, labels), 'labels.num_train': str(labels)})
        identity = dict(experiment=self.exp_name, seed=seed, hparams=hparams)
        done = read_done(reward_dir)
        if done is not None:
            self.check_reward_model(done, identity, reward_dir, num_train=labels or self.num_train)
            return
        name = os.path.basename(reward_dir)
        print(f'[frontier] seed {seed}: training its reward model into {reward_dir}', flush=True)
        # The count the sweep trains on, stated to the command whatever the experiment binds (NUM_TRAIN); the
        # identity keeps the command line's settings, and check_reward_model reads the count the model was made on.
        command = {'labels.num_train': str(self.num_train), **hparams}
        self.train_reward_command(self.exp_name, name, save_dir=self.seed_dir(seed), **command)
        files.atomic_write(os.path.join(reward_dir, DONE), json.dumps(dict(
            identity=identity, fingerprints=self.reward_fingerprints(reward_dir),
            command=launch_line('train_reward', self.exp_name, name, self.seed_dir(seed), command, self.out),
            points=[])).encode())

    def check_reward_model(self, done, identity, reward_dir, *, num_train):
        if done.get('identity') != identity:
            raise ValueError(f'{reward_dir} is a reward model of other settings ({done.get("identity")}; this sweep: '
                             f'{identity}): give this sweep another --out, or remove that folder')
        trained_on = _load_hparams('train_reward', os.path.join(reward_dir, 'train_reward_hparams.json'))
        if trained_on.labels.num_train != num_train:
            raise ValueError(f'{reward_dir} was trained on {trained_on.labels.num_train} labels (labels.num_train), '
                             f'this sweep trains on {num_train}: give this sweep another --out, or remove that folder')
        now = self.reward_fingerprints(reward_dir)
        for what, fingerprint in done.get('fingerprints', {}).items():
            if now.get(what) != fingerprint:
                raise ValueError(f'{reward_dir} was trained on other {what} than {reward_dir}\'s {what} now (sha256 '
                                 f'{fingerprint[:12]}, now {str(now.get(what))[:12]}): give this sweep another --out, '
                                 f'or remove that folder')

    def reward_fingerprints(self, reward_dir):
        """sha256 of the labels a reward model learned from and of its initial model's weights (another CPU, or a
        cleared cache, pretrains another initial model: its labels and reward model are another seed's)."""
        hparams = _load_hparams('train_reward', os.path.join(reward_dir, 'train_reward_hparams.json'))
        labels = hparams.labels.source
        model_dir = hparams.task.policy.initial_model
        weights = sorted(os.path.join(root, f) for root, _, names in os.walk(model_dir) for f in names
                         if f.endswith(('.safetensors', '.pt', '.bin')))
        assert weights, f'no weights in {model_dir}'
        return {'labels': file_sha256(labels), 'initial model': file_sha256(*weights)}

    def label_prefix_file(self, seed, labels):
        """seed<S>/labels-<N>.json: the first N of the seed's training labels and the same held-out labels after
        them (train_reward holds out the records past labels.num_train), made once."""
        path = os.path.join(self.seed_dir(seed), f'labels-{labels}.json')
        if not os.path.isfile(path):
            with open(os.path.join(self.reward_dir(seed), f'{self.exp.name}_labels.json')) as f:
                records = json.load(f)
            held_out = records[self.num_train:]
            assert len(held_out) == self.exp.held_out_labels, (len(held_out), self.exp.held_out_labels)
            files.atomic_write(path, json.dumps(records[:labels] + held_out).encode())
        return path

    def ensure_baseline(self, seed):
        """seed<S>/baseline/frontier.json: the initial policy's scores on the test queries (evaluate.seed_baseline),
        made once a seed: the origin and unit of every arm's gain there."""
        from lm_human_preferences.frontier import evaluate
        from lm_human_preferences.offline import experiment as offline_engine
        baseline_dir = os.path.join(self.seed_dir(seed), 'baseline')
        done = read_done(baseline_dir)
        if done is None:
            self.ensure_reward_model(seed)  # the seed's initial model, resolved in its hparams
            with offline_engine.cpu_threads(self.exp):
                baseline = evaluate.seed_baseline(self.exp, self.seed_hparams(seed).task, seed=seed)
            done = dict(identity=dict(experiment=self.exp_name, seed=seed), baseline=baseline, runs_on=runs_on(),
                        points=[])
            os.makedirs(baseline_dir, exist_ok=True)
            files.atomic_write(os.path.join(baseline_dir, DONE), json.dumps(done).encode())
        return done['baseline']

    def policy_hparams(self, seed, **more):
        """train_policy's hparams for a run of this seed: the command line's, the seed, then the arm's."""
        return {**self.extra, 'run.seed': str(seed), **{k: str(v) for k, v in more.items()}}

    # ---- the arms
    def run_ppo(self, run, run_dir, baseline):
        """Offline PPO (and its variants: ppo_nofilter, ppo_4x) at a fixed kl_coef against the seed's reward model."""
        hparams = {k: v for k, v in self.policy_hparams(run.seed).items() if not k.startswith(REWARD_PREFIX)}
        hparams.update({'rewards.trained_model': os.path.join(self.reward_dir(run.seed, run.labels), 'reward_model'),
                        'rewards.train_new_model': 'off', 'rewards.adaptive_kl': 'off',
                        'rewards.kl_coef': str(run.value)})
        if run.arm == 'ppo_nofilter':
            hparams['task.filter_responses'] = 'false'
        if run.arm == 'ppo_4x':
            hparams['ppo.total_episodes'] = str(4 * int(self.policy_bound('ppo.total_episodes')))
        if run.lr is not None:
            hparams['ppo.lr'] = str(run.lr)
        return self.trained_policy_point(run, run_dir, hparams, baseline)

    def run_online(self, run, run_dir, baseline):
        # The same labels budget as offline: a quarter first, the rest over the rounds (docs/labeling.md).
        hparams = self.policy_hparams(run.seed, **{'online.retrains': ONLINE_RETRAINS,
                                                   'online.num_labels': self.num_train - self.num_train // 4,
                                                   REWARD_PREFIX + 'labels.num_train': self.num_train // 4,
                                                   'rewards.adaptive_kl': 'off', 'rewards.kl_coef': run.value,
                                                   **({} if run.lr is None else {'ppo.lr': run.lr})})
        return self.trained_policy_point(run, run_dir, hparams, baseline)

    def policy_bound(self, key):
        """A train_policy hparam of the sweep: the command line's, else the experiment's binding."""
        return self.extra.get(key, self.bound[key])

    def trained_policy_point(self, run, run_dir, hparams, baseline):
        from lm_human_preferences.frontier import evaluate
        from lm_human_preferences.offline import experiment as offline_engine
        from lm_human_preferences.offline.report import report_file
        name = os.path.basename(run_dir)
        self.train_policy_command(self.exp_name, name, save_dir=self.seed_dir(run.seed), **hparams)
        with open(report_file(self.exp, run_dir)) as f:
            report = json.load(f)
        run_hparams = saved_policy_hparams(run_dir)
        with offline_engine.cpu_threads(self.exp):
            point = evaluate.policy_point(self.exp, run_hparams, os.path.join(run_dir, 'policy'), run_dir,
                                          seed=run.seed, baseline=baseline, report=report)
        command = launch_line('train_policy', self.exp_name, name, self.seed_dir(run.seed), hparams, self.out)
        # its compute: the episodes it sampled, its Adam steps (PPO's batches x epochs x minibatches)
        ppo = run_hparams.ppo
        steps = ppo.total_episodes // ppo.batch_size * ppo.noptepochs * ppo.nminibatches
        return command, [dict(value=float(hparams['rewards.kl_coef']), **point, samples=ppo.total_episodes,
                              optimizer_steps=steps)]

    def seed_hparams(self, seed, labels=None):
        """train_policy's hparams of this seed's runs against its reward model, resolved (the task with its initial
        model's dir), for the arms that run no trainer."""
        from lm_human_preferences import train_policy
        hparams = train_policy.HParams()
        reward = _load_hparams('train_reward', os.path.join(self.reward_dir(seed), 'train_reward_hparams.json'))
        # The seed's task, its initial model resolved to the dir its reward model's run used (its weights checked
        # by check_reward_model's fingerprints).
        hparams.task = reward.task
        hparams.rewards.trained_model = os.path.join(self.reward_dir(seed, labels), 'reward_model')
        return hparams

    def run_best_of_n(self, run, run_dir, baseline):
        from lm_human_preferences.frontier import evaluate
        from lm_human_preferences.offline import experiment as offline_engine
        os.makedirs(run_dir, exist_ok=True)
        hparams = self.seed_hparams(run.seed, run.labels)
        with offline_engine.cpu_threads(self.exp):
            identity = dict(experiment=self.exp_name, seed=run.seed,
                            initial_model=self.reward_fingerprints(self.reward_dir(run.seed))['initial model'])
            points = evaluate.best_of_n_points(self.exp, hparams, self.points['best_of_n'], run_dir,
                                               queries=self.best_of_n_queries, seed=run.seed, baseline=baseline,
                                               samples_dir=self.best_of_n_samples_dir(run.seed),
                                               identity=identity)
        reward_model = os.path.relpath(hparams.rewards.trained_model, self.out)
        command = (f"python sample.py best_of_n --save_dir <a train_policy run of seed {run.seed} with "
                   f"--rewards.trained_model $OUT/{reward_model}> --n N --queries Q --seed {run.seed} (its ppo_score "
                   f"column; n up to {evaluate.ALL_QUERIES_MAX_N} on {self.best_of_n_queries} queries, larger n on "
                   f"queries x {evaluate.ALL_QUERIES_MAX_N} / n)")
        return command, points

    def best_of_n_samples_dir(self, seed):
        """One draw of best-of-n's samples a seed, ranked by each label count's reward model (evaluate.py)."""
        return os.path.join(self.seed_dir(seed), 'best_of_n_samples')

    def best_of_n_samples_kept(self, seed):
        path = self.best_of_n_samples_dir(seed)
        return os.path.isdir(path) and any(name.endswith('.safetensors') for name in os.listdir(path))

    def run_dpo(self, run, run_dir, baseline):
        from lm_human_preferences.frontier import dpo, evaluate
        from lm_human_preferences.language import hf_export
        from lm_human_preferences.offline import experiment as offline_engine
        hparams = self.seed_hparams(run.seed, run.labels)
        initial_hf = os.path.join(self.seed_dir(run.seed), 'initial_hf')
        if read_done(initial_hf) is None:
            hf_export.export(hparams.task.policy.initial_model, initial_hf, task=hparams.task, force=True)
            files.atomic_write(os.path.join(initial_hf, DONE), b'{}')
        reward = _load_hparams('train_reward', os.path.join(self.reward_dir(run.seed), 'train_reward_hparams.json'))
        with open(os.path.join(self.reward_dir(run.seed), f'{self.exp.name}_labels.json')) as f:
            training = json.load(f)[:reward.labels.num_train]  # the held-out labels stay held out
        # the label axis: the first `labels` of them
        records = training if run.labels is None else training[:run.labels]
        rows, pairs = dpo.preference_rows(records, hparams.task, self.exp.encoding.name, reward.labels.type)
        policy_hf = os.path.join(run_dir, 'policy_hf')
        options = dict(self.dpo_options, learning_rate=self.default_lr['dpo'] if run.lr is None else run.lr)
        steps = None
        if run.labels is not None:
            # The label axis varies the labels alone: on fewer labels DPO takes the full count's optimizer steps (as
            # many passes over its pairs as they take), as PPO takes its own steps on every count's reward model. One
            # pass over 1,024 labels' pairs is ~22 steps, too few to move the policy to 6 nats at any beta.
            full_rows, _ = dpo.preference_rows(training, hparams.task, self.exp.encoding.name, reward.labels.type)
            steps = dpo.optimizer_steps(len(full_rows['prompt']), **self.dpo_options)
        with offline_engine.cpu_threads(self.exp):
            dpo.train(initial_hf, rows, policy_hf, os.path.join(run_dir, 'trl'), beta=run.value, seed=run.seed,
                      steps=steps, **options)
            point = evaluate.policy_point(self.exp, hparams, policy_hf, run_dir, seed=run.seed, baseline=baseline)
        with open(os.path.join(policy_hf, dpo.TRAINED)) as f:
            trained = json.load(f)
        labels_file = os.path.relpath(os.path.join(self.reward_dir(run.seed), self.exp.name + '_labels.json'), self.out)
        command = (f'TRL DPOTrainer (frontier/dpo.py) on {len(rows["prompt"])} pairs of the first {len(records)} '
                   f'records of $OUT/{labels_file} under PPO\'s objective ({pairs["kept"]} as labelled, '
                   f'{pairs["flipped"]} flipped, {pairs["dropped"]} dropped: dpo.objective_pair), '
                   + ('' if steps is None else f'{steps} steps (the {len(training)} records\' one pass), ') + 'from '
                   f'$OUT/{os.path.relpath(initial_hf, self.out)}, beta {run.value:g}, '
                   f'lr {options["learning_rate"]:g}; '
                   f'evaluated as --task.policy.initial_model $OUT/{os.path.relpath(policy_hf, self.out)}')
        return command, [dict(value=run.value, **point, pairs=pairs, samples=0, optimizer_steps=trained['steps'],
                              dpo_final_loss=trained.get('final_loss'),
                              dpo_final_pair_accuracy=trained.get('final_pair_accuracy'))]


def labels_num_train(exp_name, extra, bound):
    """The sweep's labels.num_train: the command line's, else the frontier's own (NUM_TRAIN), else the experiment's."""
    return int(extra.get(REWARD_PREFIX + 'labels.num_train',
                         NUM_TRAIN.get(exp_name, bound[REWARD_PREFIX + 'labels.num_train'])))


def _load_hparams(command, path):
    from lm_human_preferences import train_policy, train_reward
    hparams = (train_policy if command == 'train_policy' else train_reward).HParams()
    hparams.override_from_json_file(path)
    return hparams


def saved_policy_hparams(run_dir):
    return _load_hparams('train_policy', os.path.join(run_dir, 'train_policy_hparams.json'))


def read_done(run_dir):
    """The run's frontier.json (None before it is finished)."""
    path = os.path.join(run_dir, DONE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def launch_line(command, exp, name, save_dir, hparams, out):
    """The trainer's command line, its paths under the sweep's folder written $OUT/... (runnable with OUT set)."""
    def rel(value):
        value = str(value)
        inside = os.path.isabs(value) and os.path.commonpath([os.path.abspath(out), value]) == os.path.abspath(out)
        return '$OUT/' + os.path.relpath(value, out) if inside else shlex.quote(value)
    return ' '.join(['python launch.py', command, exp, name, '--save_dir', rel(save_dir)]
                    + [f'--{k} {rel(v)}' for k, v in hparams.items()])


def file_sha256(*paths):
    digest = hashlib.sha256()
    for path in paths:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 20), b''):
                digest.update(block)
    return digest.hexdigest()


def runs_on():
    """The CPU or GPU a run ran on (its kernels round its results; on a CPU the initial model follows them)."""
    from lm_human_preferences.utils import core as utils
    from lm_human_preferences.utils import cpu
    return cpu.runs_on(utils.get_device())


def start_attempt(run_dir):
    """Note this process's start in the run's attempts, and the end of the process before it: its last write into the
    run's folder, read as this one starts (a process killed with -9 says nothing of its end, and a resumed trainer may
    rewrite or rotate away what it left: TRL's checkpoints); returns the start."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, ATTEMPTS)
    attempts = _read_attempts(path)
    if attempts and attempts[-1][1] is None:
        start = attempts[-1][0]
        attempts[-1] = [start, max([w for w in _writes(run_dir) if w >= start], default=start)]
    now = time.time()
    files.atomic_write(path, json.dumps(attempts + [[now, None]]).encode())
    return now


def attempts_seconds(run_dir, this_start):
    """The run's time over all its processes: this one's, and each earlier one's from its start to its end noted by
    the next (before ends were noted, a file holds starts alone: to its last write before the next started)."""
    attempts = _read_attempts(os.path.join(run_dir, ATTEMPTS))
    writes = _writes(run_dir)
    seconds = time.time() - this_start
    for (start, end), (next_start, _) in zip(attempts, attempts[1:]):
        if end is None:
            end = max([w for w in writes if start <= w < next_start], default=start)
        seconds += end - start
    return seconds


def _read_attempts(path):
    """[[start, end or None], ...]; a file of starts alone (as runs wrote it before ends were noted) reads as such."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [a if isinstance(a, list) else [a, None] for a in json.load(f)]


def _writes(run_dir):
    return [os.path.getmtime(os.path.join(root, name)) for root, _, names in os.walk(run_dir) for name in names
            if name != ATTEMPTS]
