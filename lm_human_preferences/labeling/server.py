"""Ours: the labeling page's HTTP server: the page (page/, no asset from the network) and a small JSON API over a
labeling session (store.py). Werkzeug (which TensorBoard, a core dependency, brings already) does the HTTP:
parsing, routing, errors; this file says what each request does.

    GET  /                      the page (the labeler's name and secret come in its link: ?labeler=NAME&key=KEY)
    GET  /page/<file>           its script and style sheet (those two names only)
    GET  /api/next?labeler=&key=      the labeler's next question (its responses in their shown order), or a
                                      state: done (the labels wanted are given), waiting (no session open: the
                                      online loop is training), empty (nothing open for them now)
    POST /api/answer  {labeler, key, question, choice, seconds}   choice: the position picked (best_of_N) or
                                      the value on the scale (scalar_rating, scalar_compare)
    POST /api/skip    {labeler, key, question}
    POST /api/undo    {labeler, key}
    GET  /api/status            progress, agreement, pi beats rho, per-labeler counts (no secrets)

A bad request (an unknown question, a second answer, a malformed body, a wrong key, any other path) gets a
JSON error with its status (400, 403, 404, 405, 409) and changes nothing.
"""

import json
import os
import socket
import threading
from pathlib import Path

from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.serving import WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

from lm_human_preferences.labeling.store import COMPARE_SCALE, RATING_SCALE, LabelingError
from lm_human_preferences.language import encodings

PAGE_DIR = Path(__file__).with_name('page')
PAGE_FILES = {'label.js': 'text/javascript', 'label.css': 'text/css'}
LOOPBACK = ('127.0.0.1', 'localhost', '::1')
WAITING = 'No questions are open: new ones come when the run asks for them. This page looks again every few seconds.'


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args, **kwargs):  # one line per request would bury the command's progress lines
        pass


def is_loopback(host):
    return host in LOOPBACK


def _json(data, status=200):
    return Response(json.dumps(data), status=status, mimetype='application/json',
                    headers={'Cache-Control': 'no-store'})


class LabelServer:
    """Serves the page over the current session (set_session: the label command's one, or the online loop's
    session of each round; None between rounds). more_questions(store): called when a labeler finds nothing
    open, to add a batch (the label command makes questions as they are needed); it returns whether it added
    any."""

    def __init__(self, *, host='127.0.0.1', port=0, more_questions=None):
        self.host = host
        self.more_questions = more_questions
        self.store = None
        self.waiting = WAITING
        self._encoders = {}
        self.making = threading.Lock()  # one batch of questions made at a time, whoever asks
        self.url_map = Map([
            Rule('/', endpoint='page', methods=['GET']),
            Rule('/page/<name>', endpoint='page_file', methods=['GET']),
            Rule('/api/next', endpoint='next', methods=['GET']),
            Rule('/api/answer', endpoint='answer', methods=['POST']),
            Rule('/api/skip', endpoint='skip', methods=['POST']),
            Rule('/api/undo', endpoint='undo', methods=['POST']),
            Rule('/api/status', endpoint='status', methods=['GET']),
        ])
        # The socket bound here, not by Werkzeug, which prints its own lines and exits when the port is taken.
        family = socket.AF_INET6 if ':' in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as listening:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a killed run held: free again
            try:
                listening.bind((host, port))
            except OSError as e:
                raise OSError(f'cannot serve the labeling page on {host} port {port}: {e.strerror} (another label '
                              f'command or online run? give another port; 0 picks a free one)') from None
            listening.listen(128)
            self.port = listening.getsockname()[1]
            self.server = make_server(host, self.port, self, threaded=True, request_handler=_QuietHandler,
                                      fd=listening.fileno())
        self._thread = None

    # ---------------------------------------------------------------------------------------------------
    def set_session(self, store, waiting=WAITING):
        """Serve store's questions (None: none, the page says `waiting`)."""
        self.store, self.waiting = store, waiting

    def link(self, labeler=None, key=None):
        """The page's URL, for a labeler (with their secret, when the session names its labelers)."""
        host = socket.gethostname() if self.host in ('0.0.0.0', '::') else self.host
        url = f'http://{host}:{self.port}/'
        if labeler is None:
            return url
        return url + f'?labeler={labeler}' + (f'&key={key}' if key else '')

    def start(self):
        self._thread = threading.Thread(target=self.server.serve_forever, name='label-server', daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join()

    # ---------------------------------------------------------------------------------------------------
    def __call__(self, environ, start_response):
        request = Request(environ)
        try:
            endpoint, args = self.url_map.bind_to_environ(environ).match()
            response = getattr(self, f'on_{endpoint}')(request, **args)
        except LabelingError as e:
            response = _json(dict(error=str(e)), e.status)
        except HTTPException as e:  # no such path (404), a wrong method (405), a body that is no JSON (400)
            response = _json(dict(error=f'{request.method} {request.path}: {e.description}'), e.code)
        return response(environ, start_response)

    def on_page(self, request):
        return Response((PAGE_DIR / 'index.html').read_bytes(), mimetype='text/html',
                        headers={'Cache-Control': 'no-store'})

    def on_page_file(self, request, name):
        if name not in PAGE_FILES:  # only the page's own files: no path reaches anything else
            return _json(dict(error=f'no such file: {request.path}'), 404)
        return Response((PAGE_DIR / name).read_bytes(), mimetype=PAGE_FILES[name])

    def _body(self, request, *fields):
        try:
            body = json.loads(request.get_data(as_text=True) or 'null')
        except ValueError:
            raise LabelingError('the request body is not JSON', 400) from None
        if not isinstance(body, dict):
            raise LabelingError('the request body must be a JSON object', 400)
        missing = [f for f in fields if f not in body]
        if missing:
            raise LabelingError(f'the request body lacks {", ".join(missing)}', 400)
        return body

    def _labeler(self, store, values):
        if store is None:
            raise LabelingError('no labeling session is open', 409)
        return store.check_labeler(values.get('labeler'), values.get('key'))

    def _describe(self, store, question, order):
        texts = store.session['texts']
        encoder = self._encoders.get(texts['encoding'])
        if encoder is None:
            encoder = self._encoders[texts['encoding']] = encodings.get(texts['encoding']).get_encoder()
        return dict(id=question['id'],
                    query=texts['query_prefix'] + encoder.decode(question['query']) + texts['query_suffix'],
                    responses=[encoder.decode(question[store.sample_keys[j]]) for j in order])

    def _session_info(self, store, labeler):
        return dict(label_type=store.label_type, label=store.label_key, instruction=store.session['instruction'],
                    responses=len(store.sample_keys), labeler=labeler,
                    scale=dict(score=RATING_SCALE, difference=COMPARE_SCALE).get(store.label_key),
                    progress=store.progress(labeler))

    def on_next(self, request):
        store = self.store
        if store is None:
            return _json(dict(state='waiting', message=self.waiting))
        labeler = self._labeler(store, request.args)
        found = store.next_for(labeler)
        if found is None and not store.complete() and self.more_questions is not None:
            with self.making:
                found = store.next_for(labeler)
                if found is None and self.more_questions(store):
                    found = store.next_for(labeler)
        info = self._session_info(store, labeler)
        if found is None:
            if store.complete() or store.closed:
                return _json(dict(info, state='done', message='All the labels wanted are given. Thank you!'))
            return _json(dict(info, state='empty', message='No question is open for you right now (the others are '
                                                           'with other labelers). This page looks again every few '
                                                           'seconds.'))
        question, order = found
        return _json(dict(info, state='question', question=self._describe(store, question, order)))

    def on_answer(self, request):
        body = self._body(request, 'question', 'choice')
        store = self.store
        labeler = self._labeler(store, body)
        seconds = body.get('seconds')
        store.answer(labeler, body['question'], body['choice'],
                     client_seconds=seconds if isinstance(seconds, (int, float)) else None)
        return _json(dict(ok=True, progress=store.progress(labeler)))

    def on_skip(self, request):
        body = self._body(request, 'question')
        store = self.store
        labeler = self._labeler(store, body)
        store.skip(labeler, body['question'])
        return _json(dict(ok=True, progress=store.progress(labeler)))

    def on_undo(self, request):
        body = self._body(request)
        store = self.store
        labeler = self._labeler(store, body)
        question = store.undo(labeler)
        return _json(dict(ok=True, question=question, progress=store.progress(labeler)))

    def on_status(self, request):
        store = self.store
        if store is None:
            return _json(dict(state='waiting', message=self.waiting))
        return _json(dict(state='done' if store.complete() else 'open', progress=store.progress(),
                          agreement=store.agreement(), pi_beats_rho=store.policy_wins(), labelers=store.log_summary(),
                          directory=os.path.abspath(store.directory)))
