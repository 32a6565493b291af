"""The labeling page as people use it: `python launch.py label` serves it, a real browser (Debian's chromium, driven
by Selenium; nothing downloaded) labels with keys and clicks, skips, undoes, reloads half-way, while a second
labeler answers in another window; the labels round-trip through train_reward, which trains the same reward model
on them as on the same labels written by a program. And the server killed with SIGKILL mid-session: a rerun serves
the rest and never asks a labeler the same question twice. And a page of another origin in the same browser, which
fetches the API as issue #47's attack did: nothing it sends is kept."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import headless_chromium
from lm_human_preferences.language import encodings

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # a browser and several commands: the full suite only


def env():
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', CUDA_VISIBLE_DEVICES='')
    return e


def start_label(save_dir, *args):
    """`python launch.py label test page --port 0 ...`; returns the process and its printed links {name: url}."""
    return start_label_named(save_dir, 'page', *args)


def start_label_named(save_dir, name, *args):
    proc = subprocess.Popen([sys.executable, 'launch.py', 'label', 'test', name, '--save_dir', str(save_dir),
                             *([] if '--port' in args else ['--port', '0']), *args], cwd=REPO_ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    links, lines = {}, []
    while True:
        line = proc.stdout.readline()
        assert line, f'label ended before it served: {lines} {proc.stderr.read()[-2000:]}'
        lines.append(line)
        if m := re.match(r'\s+(\w+): (http://127\.0\.0\.1:\d+/\?\S+)', line):
            links[m.group(1)] = m.group(2)
        if m := re.match(r'\s+open (http://127\.0\.0\.1:\d+/) in a browser', line):
            links[None] = m.group(1)
        if line.startswith('  Ctrl-C stops'):
            proc.announced = ''.join(lines)
            return proc, links


class Labeler:
    """One person's window: reads what the page shows, presses keys, clicks."""

    def __init__(self, driver, url):
        self.driver, self.url = driver, url
        driver.get(url)
        # the page is up before the first questions are made: it says so, and looks again
        self.wait(lambda: self.js("const i = document.getElementById('instruction');"
                                  "return !i || (i.textContent !== 'Loading…' &&"
                                  "              !document.body.innerText.includes('being made'))"),
                  'the first questions', 120)

    def js(self, script):
        return self.driver.execute_script(script)

    def wait(self, condition, what, timeout=30):
        start = time.time()
        while time.time() - start < timeout:
            value = condition()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f'the page never showed {what}: {self.js("return document.body.innerText")[-800:]}')

    def question(self):
        """The id of the question shown (None when none), once no request is in flight."""
        return self.wait(lambda: self.js(
            "const q = document.getElementById('question');"
            "return (!q.hidden && q.dataset.id) ? q.dataset.id : (document.getElementById('state').hidden ? '' : 'none')"),
            'a question or a state')

    def responses(self):
        return self.js("return [...document.querySelectorAll('#responses .body')].map(e => e.textContent)")

    def press(self, key):
        shown = self.question()
        self.driver.find_element('tag name', 'body').send_keys(key)
        return shown

    def next_after(self, shown):
        """Wait for the page to show another question than `shown` (or a state)."""
        return self.wait(lambda: (q := self.question()) != shown and q, f'a question after {shown}')

    def progress(self):
        return self.js("return document.getElementById('progress').textContent")


def test_people_label_in_a_browser_and_the_labels_train_a_reward_model(tmp_path):
    driver_a = headless_chromium()
    driver_b = headless_chromium()
    proc, links = start_label(tmp_path, '--num', '10', '--labelers', 'ann,bob', '--overlap', '0.25')
    session = tmp_path / 'page'
    given = []  # (labeler, question id, the responses as shown, the position picked)
    try:
        ann, bob = Labeler(driver_a, links['ann']), Labeler(driver_b, links['bob'])
        assert ann.js("return document.getElementById('instruction').textContent") == 'Which response is the best?'
        assert 'labeler: ann' in ann.js("return document.getElementById('labeler').textContent")

        def answer_by_key(person, name, key):
            shown, texts = person.question(), person.responses()
            person.press(key)
            given.append((name, shown, texts, int(key) - 1))
            return person.next_after(shown)

        answer_by_key(ann, 'ann', '2')
        answer_by_key(ann, 'ann', '1')
        # a click on the third response
        shown, texts = ann.question(), ann.responses()
        ann.driver.find_elements('css selector', '#responses button')[2].click()
        given.append(('ann', shown, texts, 2))
        ann.next_after(shown)
        assert ann.progress().startswith('3 / 10 labels done · you: 3 answered')
        # skip, then undo the skip: the same question comes back
        skipped = ann.press('s')
        ann.next_after(skipped)
        ann.press('u')
        assert ann.wait(lambda: ann.question() == skipped, 'the skipped question again after undo')
        # the help overlay
        ann.press('?')
        assert ann.wait(lambda: not ann.js("return document.getElementById('help').hidden"), 'the help')
        ann.driver.find_element('tag name', 'body').send_keys('\ue00c')  # Escape
        assert ann.wait(lambda: ann.js("return document.getElementById('help').hidden"), 'the help closed')
        answer_by_key(ann, 'ann', '4')
        # reload half-way: the same question again, in the same order, the progress kept
        before_reload, texts = ann.question(), ann.responses()
        ann.driver.refresh()
        assert ann.question() == before_reload and ann.responses() == texts
        assert ann.progress().startswith('4 / 10 labels done · you: 4 answered')
        # bob, in his own window, meanwhile: first the questions ann answered that are asked twice
        for key in '3124':
            answer_by_key(bob, 'bob', key)
        answer_by_key(ann, 'ann', '2')
        assert answer_by_key(ann, 'ann', '1') == 'none'  # the 10th label ends the session: the page says so
        code = proc.wait(timeout=30)
        out, err = proc.communicate()
        assert code == 0, err[-2000:]
        driver_a.save_screenshot(str(tmp_path / 'page.png'))
    finally:
        driver_a.quit()
        driver_b.quit()
        if proc.poll() is None:
            proc.kill()
    assert re.search(r'label done: 10/10 labels \(ann 6, bob 4\); agreement \d+% on \d+ questions asked twice', out), out

    # What the page sent is what the log and the labels hold: the position picked, in the order shown, as the
    # original's record of the question's token ids and the best sample's index.
    encoder = encodings.Test.get_encoder()
    questions = {q['id']: q for q in map(json.loads, (session / 'questions.jsonl').read_text().splitlines())}
    events = [json.loads(line) for line in (session / 'answers.jsonl').read_text().splitlines()]
    answers = [e for e in events if e['event'] == 'answer']
    assert [(e['labeler'], e['question'], e['choice']) for e in answers] == [(n, q, c) for n, q, _, c in given]
    assert [e['event'] for e in events if e['event'] != 'answer'] == ['skip', 'undo']
    for e, (_, q, texts, choice) in zip(answers, given):
        assert texts == [encoder.decode(questions[q][f'sample{j}']) for j in e['order']]  # shown in the recorded order
        assert e['label']['best'] == e['order'][choice] and e['seconds'] >= 0 and e['client_seconds'] >= 0
    by_labeler = {}
    for e in answers:
        assert e['question'] not in by_labeler.setdefault(e['labeler'], set())  # nobody asked twice
        by_labeler[e['labeler']].add(e['question'])
    # A program's file of the same labels, from what the test saw and pressed alone: the question's fields and the
    # index of the sample whose text was picked.
    keys = ('query', 'sample0', 'sample1', 'sample2', 'sample3')
    program = [dict({k: questions[q][k] for k in keys},
                    best=next(j for j in range(4) if encoder.decode(questions[q][f'sample{j}']) == texts[choice]))
               for _, q, texts, choice in given]
    labels = json.loads((session / 'labels.json').read_text())
    assert len(labels) == 10 and labels == program

    # train_reward reads the page's labels unchanged, and trains the same reward model as on a program's file of
    # the same labels.
    (tmp_path / 'program.json').write_text(json.dumps(program, indent=1))
    models = []
    for source, name in ((session / 'labels.json', 'from-page'), (tmp_path / 'program.json', 'from-program')):
        run = subprocess.run([sys.executable, 'launch.py', 'train_reward', 'test', name, '--save_dir', str(tmp_path),
                              '--labels.source', str(source), '--labels.num_train', '8', '--batch_size', '8'],
                             cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert 'eval on 2 labels' in run.stdout  # the records after num_train are held out
        models.append(load_file(str(tmp_path / name / 'reward_model' / 'checkpoints' / 'model-1.safetensors')))
    assert set(models[0]) == set(models[1]) and all(torch.equal(models[0][k], models[1][k]) for k in models[0])


# The page of another origin (issue #47): a labeler who visits it while labeling must not answer through it.
HOSTILE_PAGE = """<!doctype html><title>cats</title><script>
const target = 'http://127.0.0.1:%(port)d';
async function attack() {
  const sent = [];
  const tries = [
    () => fetch(target + '/api/next?labeler=csrfsite', {mode: 'no-cors'}),
    () => fetch(target + '/api/answer', {method: 'POST', mode: 'no-cors', headers: {'Content-Type': 'text/plain'},
                body: JSON.stringify({labeler: 'csrfsite', question: 'q000000', choice: 0})}),
    () => fetch(target + '/api/answer', {method: 'POST', headers: {'Content-Type': 'application/json'},
                body: JSON.stringify({labeler: 'csrfsite', question: 'q000000', choice: 0})}),
  ];
  for (const t of tries) {
    try { await t(); sent.push('sent'); } catch (e) { sent.push('blocked'); }
  }
  document.title = 'done ' + sent.join(',');
}
attack();
</script>"""


def serve_hostile_page(label_port):
    """A second server on 127.0.0.1 (another port: another origin) serving HOSTILE_PAGE."""
    page = (HOSTILE_PAGE % dict(port=label_port)).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header('Content-Type', 'text/html')
            self.send_header('Content-Length', str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_page_of_another_origin_cannot_answer(tmp_path):
    """Issue #47's attack in the suite's Chromium: a page of another origin (127.0.0.1, another port) fetches the
    labeling API with no-cors text/plain and with JSON; nothing it sends is kept, and the labeler's own page, in
    the same browser, labels on. Typing a name with 's' and 'u' in an open session's name box neither skips nor
    undoes."""
    driver = headless_chromium()
    proc, links = start_label(tmp_path, '--num', '2')
    port = int(re.search(r':(\d+)/', links[None]).group(1))
    hostile = serve_hostile_page(port)
    session = tmp_path / 'page'
    try:
        driver.get(f'http://127.0.0.1:{hostile.server_address[1]}/')
        Labeler(driver, driver.current_url).wait(lambda: driver.title.startswith('done'), 'the attack finished')
        person = Labeler(driver, links[None])
        name = driver.find_element('id', 'name')
        name.send_keys('susu')
        assert name.get_attribute('value') == 'susu'
        assert person.js("return document.getElementById('banner').hidden")  # no undo or skip was sent
        name.submit()
        person.wait(lambda: person.js("return !document.getElementById('question').hidden"), 'a question', 120)
        for key in '12':
            shown = person.press(key)
            person.next_after(shown)
        assert proc.wait(timeout=60) == 0
    finally:
        driver.quit()
        hostile.shutdown()
        if proc.poll() is None:
            proc.kill()
    events = [json.loads(line) for line in (session / 'answers.jsonl').read_text().splitlines()]
    assert [e['labeler'] for e in events if e['event'] == 'answer'] == ['susu', 'susu']
    assert 'csrfsite' not in (session / 'answers.jsonl').read_text() + (session / 'labels.json').read_text()


def test_the_page_looks_again_after_a_failed_request(tmp_path):
    """The server killed under an open page: the answer fails with words a labeler reads, the page keeps asking,
    and once the same command serves again on its port the page shows the question and takes the answer, with
    no reload."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = str(s.getsockname()[1])
    driver = headless_chromium()
    proc, links = start_label(tmp_path, '--num', '2', '--port', port)
    try:
        person = Labeler(driver, links[None] + '?labeler=ann')
        shown = person.question()
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        person.driver.find_element('tag name', 'body').send_keys('1')
        banner = person.wait(lambda: person.js("const b = document.getElementById('banner');"
                                               "return b.hidden ? '' : b.textContent"), 'the failure in words')
        assert 'cannot be reached' in banner and 'Failed to fetch' not in banner
        proc, links = start_label(tmp_path, '--num', '2', '--port', port)
        person.wait(lambda: person.js("return document.getElementById('banner').hidden"), 'the server back', 60)
        assert person.question() == shown
        person.press('1')
        person.next_after(shown)
        person.press('2')
        assert proc.wait(timeout=60) == 0
    finally:
        driver.quit()
        if proc.poll() is None:
            proc.kill()
    assert len(json.loads((tmp_path / 'page' / 'labels.json').read_text())) == 2


@pytest.mark.parametrize('label_type, keys, labels', [
    ('scalar_rating', '72', [('score', 7.0), ('score', 2.0)]),
    ('scalar_compare', '17', [('difference', -3.0), ('difference', 3.0)]),  # 1: A much better; 7: B much better
])
def test_the_scalar_label_types_on_their_scales(tmp_path, label_type, keys, labels):
    driver = headless_chromium()
    proc, links = start_label(tmp_path, '--num', '2', '--labels.type', label_type)
    try:
        person = Labeler(driver, links[None] + '?labeler=ann')
        shown = []
        for key in keys:
            question = person.question()
            points = person.js("return [...document.querySelectorAll('#scale button')].map(b => b.innerText)")
            assert len(points) == 7 and points[0].startswith('1') and points[6].startswith('7')
            assert ('worst' in points[0] and 'best' in points[6]) if label_type == 'scalar_rating' else (
                'A much better' in points[0] and 'B much better' in points[6])
            shown.append((question, person.responses()))
            person.press(key)
            person.next_after(question)
        assert proc.wait(timeout=30) == 0
    finally:
        driver.quit()
        if proc.poll() is None:
            proc.kill()
    encoder = encodings.Test.get_encoder()
    questions = {q['id']: q for q in map(json.loads, (tmp_path / 'page' / 'questions.jsonl').read_text().splitlines())}
    records = json.loads((tmp_path / 'page' / 'labels.json').read_text())
    for (question, texts), record, (field, value) in zip(shown, records, labels):
        q = questions[question]
        if label_type == 'scalar_rating':
            assert texts == [encoder.decode(q['sample'])] and record == dict(query=q['query'], sample=q['sample'],
                                                                            score=value)
        else:
            # A and B as shown; the record's difference is sample1's minus sample0's
            a_is_sample0 = texts[0] == encoder.decode(q['sample0']) and texts[1] == encoder.decode(q['sample1'])
            assert record['difference'] == (value if a_is_sample0 else -value) or q['sample0'] == q['sample1']


def api(url, method='GET', body=None):
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def answer_some(base, n, timeout=120):
    """Answer n questions as 'ann' through the page's API (the page is up before the first questions are made:
    'empty' until then); their ids."""
    done = []
    start = time.time()
    while len(done) < n and time.time() - start < timeout:
        reply = api(base + 'api/next?labeler=ann')
        if reply['state'] == 'empty':
            time.sleep(0.2)
            continue
        if reply['state'] != 'question':
            break
        api(base + 'api/answer', 'POST', dict(labeler='ann', question=reply['question']['id'], choice=1))
        done.append(reply['question']['id'])
    return done


def test_a_killed_server_goes_on_where_it_was(tmp_path):
    proc, links = start_label(tmp_path, '--num', '12')
    first = answer_some(links[None], 5)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    session = tmp_path / 'page'
    assert len(json.loads((session / 'labels.json').read_text())) == 5  # every answer acknowledged is kept
    proc, links = start_label(tmp_path, '--num', '12')  # the same command: the same session
    rest = answer_some(links[None], 20)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert len(rest) == 7 and not set(first) & set(rest)  # the rest of the queue, none asked again
    labels = json.loads((session / 'labels.json').read_text())
    assert len(labels) == 12 and 'label done: 12/12 labels (ann 12)' in out


def test_questions_of_a_trained_policy_and_the_validation_form(tmp_path):
    """--policy DIR asks about a train_policy run's policy; --validation DIR sets two of its responses beside two of
    the initial model's, and says which are the policy's."""
    run = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', 'ppo', '--save_dir', str(tmp_path)],
                         cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for option, name in (('--policy', 'of-policy'), ('--validation', 'validation')):
        proc, links = start_label_named(tmp_path, name, '--num', '2', option, str(tmp_path / 'ppo'))
        answered = answer_some(links[None], 5)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and len(answered) == 2, err[-2000:]
        assert (f'responses of the initial model and the policy of {tmp_path / "ppo"} (two each)' if option ==
                '--validation' else f'responses of the policy of {tmp_path / "ppo"}') in proc.announced
        session = json.loads((tmp_path / name / 'session.json').read_text())
        assert session['origin']['run'] == str(tmp_path / 'ppo')
        questions = [json.loads(line) for line in (tmp_path / name / 'questions.jsonl').read_text().splitlines()]
        if option == '--validation':
            assert session['origin']['form'] == 'validation'
            assert all(len(q['pi_samples']) == 2 and set(q['pi_samples']) <= {0, 1, 2, 3} for q in questions)
        else:
            assert session['origin']['form'] == 'policy' and not any('pi_samples' in q for q in questions)


def test_the_label_command_refuses_what_it_cannot_serve(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, 'launch.py', 'label', 'test', 'x', '--save_dir', str(tmp_path), *args],
                              cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=120)
    beyond = run('--host', '0.0.0.0', '--port', '0')
    assert beyond.returncode == 1 and 'name the labelers with --labelers' in beyond.stderr
    assert beyond.stderr.count('\n') == 1
    both = run('--policy', str(tmp_path), '--validation', str(tmp_path))
    assert both.returncode == 1 and '--policy and --validation both name a run' in both.stderr
    no_run = run('--policy', str(tmp_path / 'nowhere'), '--port', '0')
    assert no_run.returncode == 1 and 'is no train_policy save dir' in no_run.stderr
    assert not (tmp_path / 'x').exists()  # refused before anything was made
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = run('--port', str(port))
    assert in_use.returncode == 1 and in_use.stderr.count('\n') == 1
    assert f'cannot serve the labeling page on 127.0.0.1 port {port}: Address already in use' in in_use.stderr
    assert not (tmp_path / 'x').exists()  # nothing made: the corrected rerun may name its labelers
    bad_origin = run('--origin', 'labels.example.org/x', '--labelers', 'ann')
    assert bad_origin.returncode == 1 and '--origin' in bad_origin.stderr and bad_origin.stderr.count('\n') == 1
    proxied = run('--origin', 'https://labels.example.org', '--port', '0')
    assert proxied.returncode == 1 and 'name the labelers with --labelers' in proxied.stderr


def test_a_rerun_with_other_labelers_or_overlap_is_refused(tmp_path):
    proc, links = start_label(tmp_path, '--num', '1', '--labelers', 'ann,bob', '--overlap', '0.25')
    proc.kill()
    proc.communicate()
    for args, says in ((['--labelers', 'ann,bob,carl', '--overlap', '0.25'], '--labelers ann,bob,carl: '),
                       (['--labelers', 'ann,bob'], '--overlap 0.05: ')):
        rerun = subprocess.run([sys.executable, 'launch.py', 'label', 'test', 'page', '--save_dir', str(tmp_path),
                                '--port', '0', *args], cwd=REPO_ROOT, env=env(), capture_output=True, text=True,
                               timeout=120)
        assert rerun.returncode == 1 and rerun.stderr.count('\n') == 1 and says in rerun.stderr, rerun.stderr
        assert 'was started with' in rerun.stderr and 'another NAME' in rerun.stderr
