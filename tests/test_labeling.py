"""The labeling session (labeling/store.py), its questions (questions.py), its HTTP API (server.py, through real
requests on 127.0.0.1) and the export to TRL's preference format (export.py). The page in a real browser, the
command line and kill -9 of the server: tests/test_labeling_page.py."""
import functools
import http.client
import importlib.util
import json
import os
import re
import time
import urllib.error
from pathlib import Path
import urllib.request

import numpy as np
import pytest
import torch

from lm_human_preferences import label_types, lm_tasks, train_reward
from lm_human_preferences.labeling import export, questions, schedule as schedule_module, session_stats
from lm_human_preferences.labeling import session_log, store as store_module
from lm_human_preferences.labeling.server import LabelServer
from lm_human_preferences.labeling.errors import LabelingError
from lm_human_preferences.labeling.store import LabelStore
from lm_human_preferences.language import encodings, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import ranks

TEXTS = dict(encoding='test', query_prefix='', query_suffix='')
PAD = encodings.Test.get_encoder().padding_token


def make_questions(n, *, label_type='best_of_4', seed=0, query_length=2, response_length=3, pi=False):
    """n questions of the test vocabulary (letters), each response distinct."""
    rng = np.random.RandomState(seed)
    keys = store_module.sample_keys(label_type)
    made = []
    for _ in range(n):
        q = dict(query=rng.randint(0, 26, size=query_length).tolist(), origin='test')
        for k in keys:
            q[k] = rng.randint(0, 26, size=response_length).tolist()
        if pi:
            q['pi_samples'] = [2, 3]
        made.append(q)
    return made


def new_store(tmp_path, n=10, *, label_type='best_of_4', labelers=None, overlap=0.0, target=None, **kw):
    store = LabelStore.create(str(tmp_path / 'session'), label_type=label_type, instruction='Which?', texts=TEXTS,
                              labelers=labelers, overlap=overlap, target=target, seed=3)
    store.add_questions(make_questions(n, label_type=label_type, **kw))
    return store


def schemas(label_type, query_length=2, response_length=3):
    t = label_types.get(label_type)
    return {**t.question_schemas(query_length=query_length, response_length=response_length), **t.label_schemas()}


def labels_file(store):
    with open(os.path.join(store.directory, 'labels.json')) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------
# The store

def test_answers_are_the_originals_label_records_read_by_train_reward(tmp_path):
    store = new_store(tmp_path, 6)
    given = []
    for _ in range(6):
        question, order = store.schedule.next_for('ann')
        store.answer('ann', question['id'], 2)  # the third response shown
        given.append((question, order[2]))
    records = labels_file(store)
    assert [r['best'] for r in records] == [best for _, best in given]
    assert all(set(r) == {'query', 'sample0', 'sample1', 'sample2', 'sample3', 'best'} for r in records)
    assert [r['sample0'] for r in records] == [q['sample0'] for q, _ in given]
    # train_reward's own reading of the file: every record checked against label_types' schemas.
    t = label_types.get('best_of_4')
    train, held_out = train_reward.download_labels(
        os.path.join(store.directory, 'labels.json'), t, t.question_schemas(query_length=2, response_length=3), 4,
        n_vocab=27, padding_token=PAD)
    assert train['best'].tolist() == [best for _, best in given[:4]] and len(held_out['best']) == 2


def test_shown_order_is_a_recorded_shuffle_the_same_on_every_showing(tmp_path):
    store = new_store(tmp_path, 30)
    orders = {tuple(store.shown_order(q, 'ann')) for q in store.order}
    assert len(orders) > 5 and all(sorted(o) == [0, 1, 2, 3] for o in orders)  # shuffled, a permutation each
    question, order = store.schedule.next_for('ann')
    assert store.schedule.next_for('ann') == (question, order)  # a reload shows the same question in the same order
    event = store.answer('ann', question['id'], 0)
    assert event['order'] == order and event['label'] == {'best': order[0]} and event['seconds'] is not None
    with open(os.path.join(store.directory, 'answers.jsonl')) as f:
        logged = json.loads(f.readline())
    assert logged['order'] == order and logged['labeler'] == 'ann' and logged['choice'] == 0


def test_a_labeler_is_never_asked_a_question_twice(tmp_path):
    store = new_store(tmp_path, 8)
    seen = []
    while (found := store.schedule.next_for('ann')) is not None:
        question = found[0]
        seen.append(question['id'])
        if len(seen) % 3 == 0:
            store.skip('ann', question['id'])
        else:
            store.answer('ann', question['id'], 1)
    assert sorted(seen) == sorted(store.order)  # each once, answered or skipped
    for question_id in store.order:
        with pytest.raises(store_module.NotNow):
            store.answer('ann', question_id, 0)
    # What ann skipped is open to another labeler; what she answered is not.
    skipped = [q for q in seen if store.done_by['ann'][q] == 'skip']
    bob = []
    while (found := store.schedule.next_for('bob')) is not None:
        bob.append(found[0]['id'])
        store.answer('bob', found[0]['id'], 0)
    assert sorted(bob) == sorted(skipped)


def test_two_labelers_are_not_shown_the_same_question_at_once(tmp_path):
    store = new_store(tmp_path, 4)
    a, _ = store.schedule.next_for('ann', now=100.0)
    b, _ = store.schedule.next_for('bob', now=101.0)
    assert a['id'] != b['id']
    # A lease runs out: an abandoned question goes to someone else.
    c, _ = store.schedule.next_for('cid', now=100.0 + schedule_module.LEASE_S + 1)
    assert c['id'] == a['id']


def test_questions_asked_twice_give_agreement(tmp_path):
    store = new_store(tmp_path, 20, overlap=0.25)
    assert sum(store.questions[q]['overlap'] for q in store.order) == 5  # exactly the share, spread evenly
    while (found := store.schedule.next_for('ann')) is not None:
        store.answer('ann', found[0]['id'], found[1].index(0))  # ann always picks sample 0
    # bob is offered the questions ann answered that are asked twice first.
    bob = []
    while (found := store.schedule.next_for('bob')) is not None:
        bob.append(found[0]['id'])
        question, order = found
        store.answer('bob', question['id'], order.index(0 if len(bob) <= 3 else 1))
    assert bob == [q for q in store.order if store.questions[q]['overlap']]
    agreement = session_stats.agreement(store)
    assert agreement == dict(pairs=5, agree=3 / 5, chance=0.25)
    assert len(labels_file(store)) == 25  # both answers of a question asked twice are labels


def test_undo_takes_back_the_last_answer_or_skip(tmp_path):
    store = new_store(tmp_path, 5)
    first, order = store.schedule.next_for('ann')
    store.answer('ann', first['id'], 0)
    second, _ = store.schedule.next_for('ann')
    store.skip('ann', second['id'])
    assert store.undo('ann') == second['id']  # the skip
    assert store.schedule.next_for('ann')[0]['id'] == second['id']  # shown again, next
    assert store.undo('ann') == first['id']  # then the answer
    assert labels_file(store) == []
    assert session_stats.progress(store, 'ann') == dict(done=0, target=5, mine=0, skipped=0)
    with pytest.raises(LabelingError, match='no answer or skip to undo'):
        store.undo('ann')
    store.answer('ann', first['id'], 3)  # answered again after the undo
    assert [r['best'] for r in labels_file(store)] == [order[3]]
    # Reopened from its files, the session is as it was: the log is the truth.
    store.close_files()
    reopened = LabelStore(store.directory)
    assert session_stats.progress(reopened, 'ann') == dict(done=1, target=5, mine=1, skipped=0)
    assert [e['question'] for e in reopened.events] == [first['id']]


def test_a_kill_loses_at_most_the_event_being_written(tmp_path):
    store = new_store(tmp_path, 6)
    for _ in range(3):
        question, _ = store.schedule.next_for('ann')
        store.answer('ann', question['id'], 1)
    store.close_files()
    directory = store.directory
    answers = os.path.join(directory, 'answers.jsonl')
    with open(answers, 'ab') as f:  # an answer cut off mid-write by kill -9
        f.write(b'{"event": "answer", "question": "q00000')
    # and a batch of questions cut off mid-append (none of it was ever shown)
    with open(os.path.join(directory, 'questions.jsonl'), 'ab') as f:
        f.write((json.dumps(dict(make_questions(1)[0], id='q000006', batch=1, batch_size=4, overlap=False)) + '\n'
                 ).encode())
    reopened = LabelStore(directory)
    assert len(reopened.order) == 6 and reopened.batches == 1  # the partial batch is gone
    assert session_stats.progress(reopened, 'ann')['done'] == 3 and len(labels_file(reopened)) == 3
    question, _ = reopened.schedule.next_for('ann')
    assert question['id'] not in reopened.done_by['ann']  # never one she answered
    reopened.answer('ann', question['id'], 0)  # the next append starts a line of its own
    reopened.close_files()
    assert session_stats.progress(LabelStore(directory))['done'] == 4


def test_a_damaged_question_file_is_named_never_emptied_and_restored_from_its_batch_made_again(tmp_path):
    """A torn last line of questions.jsonl while answers.jsonl holds answers to its batch is damage, not a kill (a
    batch is on disk before any of it is shown): one line naming the file and what to do, the file untouched;
    the batch made again (the same) is written back, and every answer stays."""
    store = new_store(tmp_path, 6)
    for _ in range(3):
        question, _ = store.schedule.next_for('ann')
        store.answer('ann', question['id'], 1)
    store.close_files()
    path = tmp_path / 'session' / 'questions.jsonl'
    path.write_bytes(path.read_bytes()[:-40])
    damaged = path.read_bytes()
    for writable in (True, False):
        with pytest.raises(session_log.DamagedSession) as e:
            LabelStore(store.directory, writable=writable)
        assert str(path) in str(e.value) and 'restore it from a copy' in str(e.value) and '\n' not in str(e.value)
        assert e.value.batch == 0 and path.read_bytes() == damaged  # never emptied
    with pytest.raises(session_log.DamagedSession, match='made again differs'):
        LabelStore.restore_batch(store.directory, 0, make_questions(6, seed=1))
    restored = LabelStore.restore_batch(store.directory, 0, make_questions(6))
    assert len(restored.order) == 6 and session_stats.progress(restored)['done'] == 3
    assert len(labels_file(restored)) == 3
    restored.close_files()
    # answers to questions the file lacks altogether: named, one line
    with open(tmp_path / 'session' / 'answers.jsonl', 'a') as f:
        f.write(json.dumps(dict(event='skip', question='q000050', labeler='bob')) + '\n')
    with pytest.raises(session_log.DamagedSession, match='answers 1 questions that .* lacks \\(q000050 first\\)'):
        LabelStore(store.directory)


def test_scalar_labels_on_their_scales(tmp_path):
    rating = new_store(tmp_path / 'r', 2, label_type='scalar_rating')
    q, order = rating.schedule.next_for('ann')
    assert order == [0]
    with pytest.raises(LabelingError, match='from 1 to 7'):
        rating.answer('ann', q['id'], 9)
    rating.answer('ann', q['id'], 6)
    assert labels_file(rating)[0]['score'] == 6.0 and 'sample' in labels_file(rating)[0]
    compare = new_store(tmp_path / 'c', 40, label_type='scalar_compare')
    for _ in range(40):
        q, order = compare.schedule.next_for('ann')
        compare.answer('ann', q['id'], 2)  # "the second shown is better, by 2"
        # the difference is sample1's minus sample0's: +2 when sample1 was shown second, -2 when first
        assert compare.events[-1]['label']['difference'] == (2.0 if order == [0, 1] else -2.0)
    assert {e['label']['difference'] for e in compare.events} == {2.0, -2.0}
    for records, label_type in ((labels_file(rating), 'scalar_rating'), (labels_file(compare), 'scalar_compare')):
        label_types.validate_labels(records, schemas(label_type), n_vocab=27, padding_token=PAD, source='t')


def test_policy_wins_counts_picks_of_pi(tmp_path):
    store = new_store(tmp_path, 4, pi=True)
    for best in (2, 3, 0, 3):
        q, order = store.schedule.next_for('ann')
        store.answer('ann', q['id'], order.index(best))
    assert session_stats.policy_wins(store) == dict(wins=0.75, answers=4)


def test_secrets_and_names(tmp_path):
    store = new_store(tmp_path, 2, labelers={'ann': 'sesame'})
    assert store.check_labeler('ann', 'sesame') == 'ann'
    for name, key in (('ann', 'wrong'), ('ann', None), ('bob', 'sesame')):
        with pytest.raises(store_module.WrongLabeler):
            store.check_labeler(name, key)
    with pytest.raises(LabelingError, match='labeler name'):
        new_store(tmp_path / 'open', 1).check_labeler('../x')
    assert set(store_module.parse_labelers('a, b')) == {'a', 'b'}
    with pytest.raises(ValueError, match='names someone twice'):
        store_module.parse_labelers('a,a')


# ---------------------------------------------------------------------------------------------------
# The HTTP API

class Api:
    def __init__(self, server):
        self.port = server.port
        self.base = f'http://127.0.0.1:{server.port}'

    def raw(self, method, path, *, headers=None, body=b'', send_body=True):
        """A request with exactly these headers (Host and Content-Length included unless given): (status, reply)."""
        connection = http.client.HTTPConnection('127.0.0.1', self.port, timeout=10)
        try:
            connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            headers = dict(headers or {})
            headers.setdefault('Host', f'127.0.0.1:{self.port}')
            if method == 'POST':
                headers.setdefault('Content-Length', str(len(body)))
            for k, v in headers.items():
                connection.putheader(k, v)
            connection.endheaders()
            if send_body and body:
                connection.send(body)
            reply = connection.getresponse()
            data = reply.read()
            return reply.status, json.loads(data) if reply.getheader('Content-Type') == 'application/json' else data
        finally:
            connection.close()

    def call(self, method, path, body=None, raw=None):
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={'Content-Type': 'application/json'})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def json(self, method, path, body=None, raw=None):
        status, data = self.call(method, path, body, raw)
        return status, json.loads(data)


@pytest.fixture
def api(tmp_path):
    store = new_store(tmp_path, 6, labelers={'ann': 'k1', 'bob': 'k2'})
    server = LabelServer(host='127.0.0.1', port=0)
    server.set_session(store)
    server.start()
    yield Api(server), store
    server.stop()
    store.close_files()


def snapshot(store):
    with open(os.path.join(store.directory, 'answers.jsonl'), 'rb') as f:
        return f.read(), len(store.events)


def test_api_serves_a_question_and_takes_its_answer(api):
    api, store = api
    status, page = api.call('GET', '/')
    assert status == 200 and b'/page/label.js' in page
    assert api.call('GET', '/page/label.js')[0] == 200 and api.call('GET', '/page/label.css')[0] == 200
    status, reply = api.json('GET', '/api/next?labeler=ann&key=k1')
    assert status == 200 and reply['state'] == 'question' and reply['instruction'] == 'Which?'
    question = store.questions[reply['question']['id']]
    order = store.shown_order(question['id'], 'ann')
    encoder = encodings.Test.get_encoder()
    assert reply['question']['responses'] == [encoder.decode(question[f'sample{j}']) for j in order]
    assert reply['question']['query_tokens'] == len(question['query'])  # the page says all the model saw
    status, reply = api.json('POST', '/api/answer', dict(labeler='ann', key='k1', question=question['id'], choice=1,
                                                         seconds=2.5))
    assert status == 200 and reply['progress']['done'] == 1
    assert store.events[-1]['label'] == {'best': order[1]} and store.events[-1]['client_seconds'] == 2.5
    status, reply = api.json('GET', '/api/status')
    assert reply['progress']['done'] == 1 and 'k1' not in json.dumps(reply)  # no secret leaves the server


@pytest.mark.parametrize('method, path, body, raw, status, says', [
    ('POST', '/api/answer', dict(labeler='ann', key='k1', question='q999999', choice=0), None, 404, 'unknown question'),
    ('POST', '/api/answer', None, b'{"labeler": "ann", "key"', 400, 'not JSON'),
    ('POST', '/api/answer', ['ann'], None, 400, 'JSON object'),
    ('POST', '/api/answer', dict(labeler='ann', key='k1', choice=0), None, 400, 'lacks question'),
    ('POST', '/api/answer', dict(labeler='ann', key='k1', question='q000000', choice=7), None, 400, 'position'),
    ('POST', '/api/answer', dict(labeler='ann', key='k1', question='q000000', choice='1'), None, 400, 'a number'),
    ('POST', '/api/answer', dict(labeler='ann', key='nope', question='q000000', choice=0), None, 403, 'key is wrong'),
    ('POST', '/api/answer', dict(labeler='eve', key='k1', question='q000000', choice=0), None, 403, 'not named'),
    ('GET', '/api/next?labeler=ann', None, None, 403, 'key is wrong'),
    ('POST', '/api/undo', dict(labeler='ann', key='k1'), None, 409, 'nothing'),
    ('GET', '/api/answer', None, None, 405, ''),
    ('GET', '/../session.json', None, None, 404, ''),
    ('GET', '/page/..%2Fstore.py', None, None, 404, ''),
    ('GET', '/page/index.html.bak', None, None, 404, 'no such file'),
    ('GET', '/session.json', None, None, 404, ''),
])
def test_api_refuses_bad_requests_and_changes_nothing(api, method, path, body, raw, status, says):
    api, store = api
    before = snapshot(store)
    got, reply = api.json(method, path, body, raw)
    assert got == status and 'error' in reply
    assert says.replace('nothing', 'no answer or skip to undo') in reply['error']
    assert snapshot(store) == before


def test_api_refuses_a_second_answer(api):
    api, store = api
    question = api.json('GET', '/api/next?labeler=ann&key=k1')[1]['question']['id']
    body = dict(labeler='ann', key='k1', question=question, choice=0)
    assert api.json('POST', '/api/answer', body)[0] == 200
    before = snapshot(store)
    status, reply = api.json('POST', '/api/answer', dict(body, choice=2))
    assert status == 409 and 'answered by ann already' in reply['error'] and snapshot(store) == before
    # the same question through the other labeler: it wanted one answer, it has it
    status, reply = api.json('POST', '/api/answer', dict(body, labeler='bob', key='k2'))
    assert status == 409 and 'has all the answers it wants' in reply['error'] and snapshot(store) == before


JSON = {'Content-Type': 'application/json'}


def shown_to(api, labeler, key):
    return api.json('GET', f'/api/next?labeler={labeler}&key={key}')[1]['question']['id']


@pytest.mark.parametrize('headers, status, says', [
    ({'Content-Type': 'text/plain'}, 415, 'application/json'),  # what a page of another origin can send unasked
    ({'Content-Type': 'application/x-www-form-urlencoded'}, 415, 'application/json'),
    ({}, 415, 'application/json'),
    (dict(JSON, Origin='http://evil.example'), 403, 'only this page'),
    (dict(JSON, Origin='null'), 403, 'only this page'),
    (dict(JSON, Origin='http://127.0.0.1:1'), 403, 'only this page'),  # another port of this machine: another site
    (dict(JSON, Host='evil.example'), 403, "Host 'evil.example'"),  # DNS rebinding: a name pointed here
    (dict(JSON, Host='evil.example:{port}', Origin='http://evil.example:{port}'), 403, 'Host'),
    (dict(JSON, **{'Sec-Fetch-Site': 'cross-site'}), 403, 'another site'),
])
def test_api_refuses_what_another_site_can_send(api, headers, status, says):
    """The request of issue #47's hostile page (a no-cors POST of text/plain) and its kin: refused, nothing kept;
    the same answer with this page's headers is taken."""
    api, store = api
    question = shown_to(api, 'ann', 'k1')
    body = json.dumps(dict(labeler='ann', key='k1', question=question, choice=0)).encode()
    before = snapshot(store)
    headers = {k: v.format(port=api.port) for k, v in headers.items()}
    got, reply = api.raw('POST', '/api/answer', headers=headers, body=body)
    assert got == status and says in reply['error'], reply
    assert snapshot(store) == before
    ours = dict(JSON, Origin=f'http://127.0.0.1:{api.port}', **{'Sec-Fetch-Site': 'same-origin'})
    assert api.raw('POST', '/api/answer', headers=ours, body=body)[0] == 200 and len(store.events) == 1


def test_a_name_pointed_here_reads_nothing(api):
    api, store = api
    for path in ('/', '/api/next?labeler=ann&key=k1', '/api/status', '/page/label.js'):
        got, reply = api.raw('GET', path, headers={'Host': f'rebound.example:{api.port}'})
        assert got == 403 and 'Host' in reply['error']
    assert api.raw('GET', '/', headers={'Host': f'localhost:{api.port}'})[0] == 200
    assert not store.schedule.leases  # no question was shown


@pytest.mark.parametrize('key', ['k1', 'wrong', None])
def test_a_large_body_is_refused_before_it_is_read(api, key):
    """413 on the Content-Length alone, before the body is read or the key checked: the body is never sent here."""
    api, store = api
    before = snapshot(store)
    headers = dict(JSON, **{'Content-Length': str(300_000_000)})
    start = time.time()
    got, reply = api.raw('POST', '/api/answer', headers=headers, body=b'{' * 100, send_body=False)
    assert got == 413 and '300000000 bytes' in reply['error'] and time.time() - start < 5
    got, reply = api.raw('POST', '/api/answer', headers=dict(JSON, **{'Content-Length': '4097'}), send_body=False)
    assert got == 413
    got, _ = api.raw('POST', '/api/answer', headers=dict(JSON, **{'Transfer-Encoding': 'chunked'}), send_body=False)
    assert got == 411
    assert snapshot(store) == before


def test_answers_only_to_the_question_shown_to_the_labeler(api):
    api, store = api
    bobs = shown_to(api, 'bob', 'k2')
    never_shown = next(q for q in store.order if q != bobs)
    before = snapshot(store)
    for question in (bobs, never_shown):
        for path, extra in (('/api/answer', dict(choice=0)), ('/api/skip', {})):
            status, reply = api.json('POST', path, dict(labeler='ann', key='k1', question=question, **extra))
            assert status == 409 and f'{question} is not the one shown to ann' in reply['error']
    assert snapshot(store) == before
    assert api.json('POST', '/api/answer', dict(labeler='bob', key='k2', question=bobs, choice=0))[0] == 200


def test_links_on_every_interface_are_addresses_not_the_host_name():
    """--host 0.0.0.0 prints a link per address of the machine (its host name may resolve nowhere else, and a
    name is refused as a Host: DNS rebinding); loopback last."""
    import ipaddress
    from lm_human_preferences.labeling import server as server_module
    found = server_module.interface_addresses()
    assert found[-1] == '127.0.0.1' and all(ipaddress.ip_address(a) for a in found)
    assert len(found) == len(set(found))


def test_status_off_loopback_needs_a_labelers_key(tmp_path):
    """Behind a reverse proxy (--origin) the page is reached from the network: who labels and how much is for the
    session's labelers; on loopback it is open, and no path of this machine is shown."""
    store = new_store(tmp_path, 2, labelers={'ann': 'k1'})
    for origin in ('https://labels.example.org', None):
        server = LabelServer(host='127.0.0.1', port=0, origin=origin).start()
        server.set_session(store)
        try:
            api = Api(server)
            status, reply = api.json('GET', '/api/status')
            if origin:
                assert status == 403 and 'named labelers' in reply['error']
                proxied = {'Host': 'labels.example.org', 'Origin': 'https://labels.example.org'}
                assert api.raw('GET', '/api/status', headers=proxied)[0] == 403
                status, reply = api.raw('GET', '/api/status?labeler=ann&key=k1', headers=proxied)
            assert status == 200 and reply['labelers'] == {} and str(tmp_path) not in json.dumps(reply)
        finally:
            server.stop()
    store.close_files()


@pytest.mark.parametrize('body, says', [
    (dict(question=['q000000'], choice=0), 'expected a question id'),
    (dict(question={'id': 'q000000'}, choice=0), 'expected a question id'),
    (dict(question='q000000', choice=0, seconds=-5), 'seconds -5'),
    (dict(question='q000000', choice=0, seconds='3'), "seconds '3'"),
    (dict(question='q000000', choice=0, key=7), 'key'),
    (dict(question='q000000', choice=0, labeler=['ann']), 'labeler name'),
    (b'{"labeler": "ann", "key": "k1", "question": "q000000", "choice": 0, "seconds": NaN}', 'not JSON'),
    (b'{"labeler": "ann", "key": "k1", "question": "q000000", "choice": 0, "seconds": Infinity}', 'not JSON'),
    # Nested as deep as MAX_BODY allows: beyond the parser's depth under Python 3.10-3.12.1, not under 3.12.3 or
    # 3.13 (a list, then: not an object); either way a 400 JSON answer, never a RecursionError's 500.
    (b'[' * 2000 + b']' * 2000, 'not JSON|must be a JSON object'),
])
def test_malformed_bodies_are_400_json(api, body, says):
    api, store = api
    shown_to(api, 'ann', 'k1')
    before = snapshot(store)
    raw = body if isinstance(body, bytes) else json.dumps(dict(dict(labeler='ann', key='k1'), **body)).encode()
    status, reply = api.json('POST', '/api/answer', raw=raw)
    assert status == 400 and re.search(says, reply['error']), reply
    assert snapshot(store) == before
    json.loads((tmp := open(os.path.join(store.directory, 'answers.jsonl')).read()) or 'null',
               parse_constant=lambda c: pytest.fail(f'{c} in answers.jsonl'))
    del tmp


def test_the_page_is_up_before_the_first_questions(tmp_path):
    """The label command serves before its model is loaded and its first questions made: /api/next says so."""
    store = LabelStore.create(str(tmp_path / 'session'), label_type='best_of_4', instruction='Which?', texts=TEXTS,
                              target=2)
    server = LabelServer(host='127.0.0.1', port=0).start()
    try:
        server.set_session(store)
        status, reply = Api(server).json('GET', '/api/next?labeler=ann')
        assert status == 200 and reply['state'] == 'empty' and 'first questions are being made' in reply['message']
        server.more_questions = lambda store: bool(store.add_questions(make_questions(2)))
        assert Api(server).json('GET', '/api/next?labeler=ann')[1]['state'] == 'question'
    finally:
        server.stop()
        store.close_files()


def test_a_rating_scale_says_what_its_question_counts(tmp_path):
    """The demo's rating question counts letters: its scale's ends are its own words, not worst and best."""
    from lm_human_preferences import offline_experiments
    asks = offline_experiments.experiment('demo').labeler.instruction['score']
    for instruction, ends in ((asks, ['none', 'seven or more']), ('How good is this response?', None)):
        store = LabelStore.create(str(tmp_path / str(bool(ends))), label_type='scalar_rating', instruction=instruction,
                                  texts=TEXTS)
        store.add_questions(make_questions(1, label_type='scalar_rating'))
        server = LabelServer(host='127.0.0.1', port=0).start()
        try:
            server.set_session(store)
            assert Api(server).json('GET', '/api/next?labeler=ann')[1]['scale_ends'] == ends
        finally:
            server.stop()
            store.close_files()


def test_api_between_sessions_says_waiting(tmp_path):
    server = LabelServer(host='127.0.0.1', port=0).start()
    try:
        server.set_session(None, 'PPO is training')
        assert Api(server).json('GET', '/api/next?labeler=ann')[1] == dict(state='waiting', message='PPO is training')
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------
# Questions

@pytest.fixture
def corpus(tmp_path):
    """A `local:` query dataset of letters (the `test` dataset draws its queries from the global random stream)."""
    rng = np.random.RandomState(0)
    words = [''.join(rng.choice(list('abcdefghijklmnopqrstuvwxyz'), size=rng.randint(1, 9))) for _ in range(4000)]
    (tmp_path / 'corpus').mkdir()
    (tmp_path / 'corpus' / 'corpus.txt').write_text(' '.join(words))
    return f'local:{tmp_path / "corpus"}'


def tiny_task(dataset, **kw):
    task = lm_tasks.TaskHParams(query_length=2, query_dataset=dataset, response_length=6, start_text=None, **kw)
    task.policy.initial_model = 'test'
    return task


def tiny_policy(task):
    torch.manual_seed(0)
    policy = Policy.for_task(trained_models.TrainedModel('test'), task)
    policy.requires_grad_(False)
    return policy


def test_questions_pass_the_truncation_filter_and_are_the_same_when_made_again(corpus):
    task = tiny_task(corpus, truncate_token=4, truncate_after=1)  # 'e' ends a response, after its first token
    policy = tiny_policy(task)
    passes = lm_tasks.filter_fn_from_hparams(task)
    with ranks.carry(1):
        source = questions.QuestionSource(task=task, label_type='best_of_4', policy=policy, size=32, seed=5)
        made = source.batch(0)
        again = questions.QuestionSource(task=task, label_type='best_of_4', policy=policy, size=32, seed=5).batch(0)
        unfiltered = questions.QuestionSource(task=task, label_type='best_of_4', policy=policy, size=32, seed=5,
                                              filtered=False).batch(0)
    assert made == again
    responses = torch.tensor([q[f'sample{j}'] for q in made for j in range(4)])
    assert passes(responses).all() and len(made) + source.dropped == 32
    # Postprocessed: after the first 'e' at or after position 1, padding.
    for r in responses.tolist():
        cut = next(i for i in range(1, 6) if r[i] == 4)
        assert r[cut + 1:] == [task_pad() for _ in r[cut + 1:]]
    unfiltered_responses = torch.tensor([q[f'sample{j}'] for q in unfiltered for j in range(4)])
    assert len(unfiltered) == 32 and not passes(unfiltered_responses).all()  # the filter did something


def task_pad():
    return encodings.Test.get_encoder().padding_token


def test_questions_are_drawn_on_the_policys_device_whatever_the_command_device(corpus, monkeypatch):
    """The question maker reads its queries and draws its responses on its policies' device, not on the device the
    command would pick (utils.get_device: CUDA on a GPU machine, where a CPU policy once met CUDA queries and a CUDA
    generator). 'meta' stands in for a command's device that is not the policy's: nothing may be read or drawn
    there."""
    task = tiny_task(corpus)
    policy = tiny_policy(task)
    with ranks.carry(1):
        expected = questions.QuestionSource(task=task, label_type='best_of_2', policy=policy, size=8, seed=3).batch(0)
        monkeypatch.setattr(questions.lm_tasks.utils, 'get_device', lambda: torch.device('meta'))
        made = questions.QuestionSource(task=task, label_type='best_of_2', policy=policy, size=8, seed=3).batch(0)
        elsewhere = tiny_policy(task).to('meta')
        with pytest.raises(ValueError, match=r'^validation questions sample both policies on one device: the policy '
                                             r'is on cpu, the initial policy on meta$'):
            questions.QuestionSource(task=task, label_type='best_of_2', policy=policy, initial=elsewhere)
    assert made == expected and len(made) == 8


def test_validation_questions_set_half_of_pi_beside_half_of_rho_in_shuffled_places(corpus):
    task = tiny_task(corpus)
    rho = tiny_policy(task)
    pi = tiny_policy(task)
    with torch.no_grad():
        for p in pi.parameters():
            p.add_(torch.randn_like(p))  # another policy
    with ranks.carry(1):
        made = questions.QuestionSource(task=task, label_type='best_of_4', policy=pi, initial=rho, size=40,
                                        seed=1).batch(0)
        only_rho = questions.QuestionSource(task=task, label_type='best_of_2', policy=rho, size=40, seed=1).batch(0)
    places = [tuple(q['pi_samples']) for q in made]
    assert all(len(p) == 2 for p in places) and len(set(places)) > 3  # two each, in varied places
    # rho's responses are the ones a question of rho alone draws first (the same generator, drawn first)
    for q, r in zip(made, only_rho):
        rho_places = [j for j in range(4) if j not in q['pi_samples']]
        assert [q[f'sample{j}'] for j in rho_places] == [r['sample0'], r['sample1']]


# ---------------------------------------------------------------------------------------------------
# Export

def test_export_gives_trls_preference_pairs(tmp_path):
    import datasets
    store = new_store(tmp_path, 3)
    for best in (0, 3, 1):
        q, order = store.schedule.next_for('ann')
        store.answer('ann', q['id'], order.index(best))
    compare = new_store(tmp_path / 'c', 3, label_type='scalar_compare')
    for choice in (0, 3, -1):
        q, _ = compare.schedule.next_for('ann')
        compare.answer('ann', q['id'], choice)
    store.close_files(), compare.close_files()
    assert export.export_labels(store.directory, str(tmp_path / 'hf')) == 9  # three pairs a best-of-4 label
    rows = datasets.load_from_disk(str(tmp_path / 'hf'))
    assert rows.column_names == ['prompt', 'chosen', 'rejected', 'labeler', 'question']
    encoder = encodings.Test.get_encoder()
    first = store.questions[store.events[0]['question']]
    assert rows[0]['prompt'] == encoder.decode(first['query'])
    assert [r['chosen'] for r in rows][:3] == [encoder.decode(first['sample0'])] * 3
    assert {r['rejected'] for r in rows.select(range(3))} == {encoder.decode(first[f'sample{j}']) for j in (1, 2, 3)}
    assert export.export_labels(compare.directory, str(tmp_path / 'hf2')) == 2  # a difference of 0 prefers nothing
    pairs = datasets.load_from_disk(str(tmp_path / 'hf2'))
    second = compare.questions[compare.events[1]['question']]
    sign = compare.events[1]['label']['difference']
    assert pairs[0]['chosen'] == encoder.decode(second['sample1' if sign > 0 else 'sample0'])
    with pytest.raises(ValueError, match='not an empty folder'):
        export.export_labels(store.directory, str(tmp_path / 'hf'))
    with pytest.raises(ValueError, match='holds no labeling session'):
        export.export_labels(str(tmp_path), str(tmp_path / 'hf3'))


# ---------------------------------------------------------------------------------------------------
# What is asked

@functools.lru_cache(maxsize=None)
def launcher():
    spec = importlib.util.spec_from_file_location('top_launch', Path(__file__).resolve().parents[1] / 'launch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('experiment, asks', [
    ('sentiment', 'Which continuation is the most positive and happy?'),
    ('descriptiveness', 'Which continuation is the most vividly descriptive?'),  # the same dataset as sentiment
    ('cnndm', 'Which is the best summary of the article?'),
    ('tldr', 'Which is the best summary of the post?'),
    ('sentiment_mini', 'Which continuation is the most positive and happy?'),
    ('demo', "Which response has the most letters 'e'?"),
    ('test', 'Which response is the best?'),
])
def test_the_launcher_passes_down_the_experiments_question(experiment, asks):
    """One place: the launcher gives the label command and the online loop the experiment's question (the task's,
    not the query dataset's); a running loop's hparams name resolved models and label files, not their experiment
    (tests/test_online.py runs the loop with people on the demo)."""
    assert launcher().launch_commands.instructions(experiment)['best'] == asks
