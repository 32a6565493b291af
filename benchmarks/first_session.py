"""A person's first session, with VADER in the person's seat: `python launch.py label sentiment_mini` serves the page,
this script answers its questions through the page's API (the most positive response by VADER's compound score,
ties at random; `--think_s` seconds a question, as a person reading four responses), then trains on the labels as
the README says and prints what the policy learned. It measures what the machine adds to a person's time (how long
each question took to come, as the page fetched it) and what about a hundred labels do.

    python benchmarks/first_session.py --num 100 --train 88 [--seed 1] [--think_s 0] [--out DIR]
    python benchmarks/first_session.py --first_question    # only the wait for the first question, then stop

With empty caches (LMHP_SAVED_MODELS_DIR, LMHP_DATASETS_DIR and TMPDIR of their own, as benchmarks/cpu_kinds.sh's
`label` part gives it) the wait for the first question is a new labeler's: the initial model's pretraining, then the
first questions' sampling.
"""
import argparse
import json
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lm_human_preferences.sentiment_mini.vader import compound_score  # noqa: E402


def api(url, method='GET', body=None):
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--num', type=int, default=100)
    parser.add_argument('--train', type=int, default=88, help='labels to train on (the rest are held out)')
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--think_s', type=float, default=0.0, help="a person's seconds a question")
    parser.add_argument('--out', default='/tmp/first-session')
    parser.add_argument('--first_question', action='store_true',
                        help='stop at the first question: print the seconds until the page was up and until it came')
    args = parser.parse_args()
    out = Path(args.out)
    rng = random.Random(args.seed)
    started = time.time()
    label = subprocess.Popen([sys.executable, 'launch.py', 'label', 'sentiment_mini', 'session', '--num', str(args.num),
                              '--port', '0', '--save_dir', str(out / 'labels'), '--run.seed', str(args.seed)],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    for line in label.stdout:
        if m := re.match(r'\s+open (http://\S+) in a browser', line):
            base = m.group(1)
            break
    ready = time.time() - started
    waits = []
    while True:
        fetched = time.time()
        reply = api(base + 'api/next?labeler=vader')
        if reply['state'] in ('waiting', 'empty'):  # the page is up before the model is made and the questions
            time.sleep(0.2)
            continue
        waits.append(time.time() - fetched)
        if args.first_question:
            label.terminate()
            label.wait()
            print(json.dumps(dict(page_ready_s=round(ready, 1), first_question_s=round(time.time() - started, 1),
                                  state=reply['state'])))
            return
        if reply['state'] != 'question':
            break
        time.sleep(args.think_s)
        scores = [compound_score(text) for text in reply['question']['responses']]
        best = rng.choice([i for i, s in enumerate(scores) if s == max(scores)])
        api(base + 'api/answer', 'POST', dict(labeler='vader', question=reply['question']['id'], choice=best))
    label.wait()
    labeled = time.time() - started
    labels = out / 'labels' / 'session' / 'labels.json'
    train = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'sentiment_mini', 'first', '--save_dir', str(out),
                            '--run.seed', str(args.seed), '--rewards.train_new_model.labels.source', str(labels),
                            '--rewards.train_new_model.labels.num_train', str(args.train)],
                           cwd=REPO_ROOT, capture_output=True, text=True)
    if train.returncode:
        sys.exit(train.stderr[-3000:])
    report = json.loads((out / 'first' / 'sentiment_mini_report.json').read_text())
    waits.sort()
    print(json.dumps(dict(
        labels=args.num, trained_on=args.train, seed=args.seed,
        page_ready_s=round(ready, 1),  # the command's start (the model loaded, the first 16 questions made)
        question_wait_s=dict(median=round(waits[len(waits) // 2], 3), max=round(waits[-1], 3)),
        labeling_s=round(labeled - ready, 1), training_s=round(time.time() - started - labeled, 1),
        vader_gain_initial_stds=round(report['vader_gain_initial_stds'], 2),
        vader_gain_se=round(report['vader_gain_initial_stds_se'], 2), kl=round(report['kl'], 2),
        rm_heldout_accuracy=report.get('rm_heldout_accuracy'), held_out=args.num - args.train), indent=1))


if __name__ == '__main__':
    main()
