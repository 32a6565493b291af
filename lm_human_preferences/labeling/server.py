"""Ours: the labeling page's HTTP server: the page (page/, no asset from the network) and a small JSON API over a
labeling session (store.py). Werkzeug (which TensorBoard, a core dependency, brings already) does the HTTP:
parsing, routing, errors; this file says what each request does.

    GET  /                      the page (the labeler's name and secret come in its link: ?labeler=NAME&key=KEY)
    GET  /page/<file>           its script and style sheet (those two names only)
    GET  /api/next?labeler=&key=      the labeler's next question (its responses in their shown order), or a
                                      state: done (the labels wanted are given), waiting (no session open: the
                                      online loop is training), empty (nothing open for them now)
    POST /api/answer  {labeler, key, question, choice, seconds}   choice: the position picked (best_of_N) or
                                      the value on the scale (scalar_rating, scalar_compare); question: the one
                                      /api/next showed this labeler (no other)
    POST /api/skip    {labeler, key, question}
    POST /api/undo    {labeler, key}
    GET  /api/status            progress, agreement, pi beats rho, per-labeler counts (no secrets; off loopback,
                                      ?labeler=&key= of a named labeler)

A bad request (an unknown question, a second answer, a malformed body, a wrong key, any other path) gets a
JSON error with its status (400, 403, 404, 405, 409, 411, 413, 415) and changes nothing.

What another site cannot do (a labeler's browser visits other pages too): every request must name this server
in its Host header (the address served, or the public origin given behind a reverse proxy: a DNS name that
points elsewhere, rebound to this machine, is refused), an Origin header (a browser sends it with every POST)
must be this server's, and a POST must say `Content-Type: application/json`, which a page of another origin
cannot send without the browser asking first (a CORS preflight, which this server never grants). A body is at
most MAX_BODY bytes, refused (413) on its Content-Length before any of it is read, parsed or its key checked.
"""

import ipaddress
import json
import os
import re
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.serving import WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

from lm_human_preferences.labeling import session_stats
from lm_human_preferences.labeling.errors import BadAnswer, LabelingError, NotNow, UnknownQuestion, WrongLabeler
from lm_human_preferences.labeling.store import COMPARE_SCALE, RATING_SCALE
from lm_human_preferences.language import encodings

PAGE_DIR = Path(__file__).with_name('page')
PAGE_FILES = {'label.js': 'text/javascript', 'label.css': 'text/css'}
LOOPBACK = ('127.0.0.1', 'localhost', '::1')
WILDCARD = ('0.0.0.0', '::')
MAX_BODY = 4096  # bytes: an answer is about 150
SCALE_ENDS = re.compile(r'\(%d: ([^,()]+), %d: ([^()]+)\)' % RATING_SCALE)
STATUS = {BadAnswer: 400, WrongLabeler: 403, UnknownQuestion: 404, NotNow: 409}
WAITING = 'No questions are open: new ones come when the run asks for them. This page looks again every few seconds.'


class RequestRefused(Exception):
    """A request refused before it reaches the session: its HTTP status and one line."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args, **kwargs):  # one line per request would bury the command's progress lines
        pass


def is_loopback(host):
    return host in LOOPBACK


def check_origin(origin):
    """--origin URL (the address people open when a reverse proxy serves the page): 'https://NAME[:PORT]', or
    None. Returns it without a trailing slash; ValueError (one line) otherwise."""
    if origin is None:
        return None
    parts = urlsplit(origin)
    if parts.scheme not in ('http', 'https') or not parts.hostname or parts.path not in ('', '/') or parts.query \
            or parts.username or parts.password:
        raise ValueError(f'--origin {origin!r}: give the address people open, scheme and host only, e.g. '
                         f'https://labels.example.org (the reverse proxy passes this Host and Origin on)')
    return f'{parts.scheme}://{parts.netloc.lower()}'


def interface_addresses():
    """This machine's addresses others reach it at: the one its default route leaves from (no packet is sent),
    else those its host name resolves to; loopback last."""
    found = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(('192.0.2.1', 9))  # TEST-NET-1: a route lookup only
            found.append(probe.getsockname()[0])
    except OSError:
        pass
    try:
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    outside = [a for a in dict.fromkeys(found) if not ipaddress.ip_address(a).is_loopback]
    return outside + ['127.0.0.1']


def _json(data, status=200):
    return Response(json.dumps(data), status=status, mimetype='application/json',
                    headers={'Cache-Control': 'no-store'})


def _reject_constant(name):  # json.loads reads NaN and Infinity, which no strict JSON holds
    raise ValueError(f'{name} is no JSON number')


def _host_port(host_header):
    """(host, port) of a Host header value ('name:port', '[v6]:port'); port None when absent."""
    parts = urlsplit('//' + host_header)
    try:
        return (parts.hostname or ''), parts.port
    except ValueError:
        return '', -1


def _is_ip(name):
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class LabelServer:
    """Serves the page over the current session (set_session: the label command's one, or the online loop's
    session of each round; None between rounds). more_questions(store): called when a labeler finds nothing
    open, to add a batch (the label command makes questions as they are needed); it returns whether it added
    any. origin: the public address when a reverse proxy serves the page (check_origin)."""

    def __init__(self, *, host='127.0.0.1', port=0, more_questions=None, origin=None):
        self.host = host
        self.origin = check_origin(origin)
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
            except (OSError, OverflowError) as e:
                raise OSError(f'cannot serve the labeling page on {host} port {port}: '
                              f'{getattr(e, "strerror", None) or e} (another label command or online run? give '
                              f'another port; 0 picks a free one)') from None
            listening.listen(128)
            self.port = listening.getsockname()[1]
            self.server = make_server(host, self.port, self, threaded=True, request_handler=_QuietHandler,
                                      fd=listening.fileno())
        self._thread = None

    @property
    def beyond_loopback(self):
        """Whether others than this machine's users reach the page (another address, or a reverse proxy)."""
        return not is_loopback(self.host) or self.origin is not None

    # ---------------------------------------------------------------------------------------------------
    def set_session(self, store, waiting=WAITING):
        """Serve store's questions (None: none, the page says `waiting`)."""
        self.store, self.waiting = store, waiting

    def link(self, labeler=None, key=None):
        """The page's URL (behind a proxy its origin; on every interface the first address others reach), for a
        labeler (with their secret, when the session names its labelers)."""
        return self.links(labeler, key)[0]

    def links(self, labeler=None, key=None):
        """The page's URLs: one, or on every interface (0.0.0.0) one per address of this machine."""
        if self.origin is not None:
            bases = [self.origin + '/']
        else:
            hosts = interface_addresses() if self.host in WILDCARD else [self.host]
            bases = [f'http://{f"[{h}]" if ":" in h else h}:{self.port}/' for h in hosts]
        if labeler is None:
            return bases
        return [base + f'?labeler={labeler}' + (f'&key={key}' if key else '') for base in bases]

    def start(self):
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs=dict(poll_interval=0.1),
                                        name='label-server', daemon=True)  # stop() waits a poll at most
        self._thread.start()
        return self

    def stop(self):
        """Stop serving and free the port (again: nothing)."""
        if self._thread is not None:
            self.server.shutdown()  # waits for serve_forever: only once it was started
            self._thread.join()
            self._thread = None
        self.server.server_close()

    # ---------------------------------------------------------------------------------------------------
    def __call__(self, environ, start_response):
        request = Request(environ)
        try:
            self._check_request(request)
            endpoint, args = self.url_map.bind_to_environ(environ).match()
            response = getattr(self, f'on_{endpoint}')(request, **args)
        except RequestRefused as e:
            response = _json(dict(error=str(e)), e.status)
            if e.status in (411, 413):
                response.headers['Connection'] = 'close'  # the body is never read
        except LabelingError as e:
            response = _json(dict(error=str(e)), STATUS[type(e)])
        except HTTPException as e:  # no such path (404), a wrong method (405)
            response = _json(dict(error=f'{request.method} {request.path}: {e.description}'), e.code)
        except Exception as e:  # a bug of ours: one line here and a JSON error there, the session unchanged
            print(f'label server: {request.method} {request.path} failed: {type(e).__name__}: {e}', file=sys.stderr,
                  flush=True)
            response = _json(dict(error='the server failed on this request (its terminal says why)'), 500)
        return response(environ, start_response)

    def _allowed_host(self, host_header):
        """Whether a Host header names this server: the public origin's host, or the address served (on every
        interface: any IP address of it, or localhost; never a DNS name, which another site can point here)."""
        if self.origin is not None and host_header.lower() == urlsplit(self.origin).netloc:
            return True
        name, port = _host_port(host_header)
        if port != self.port:
            return False
        if self.host in WILDCARD:
            return name == 'localhost' or _is_ip(name)
        if is_loopback(self.host):
            return name in LOOPBACK
        return name == self.host.lower()

    def _check_request(self, request):
        """What every request must hold before anything is read of its body (the module's docstring)."""
        if request.method == 'POST':
            if request.content_length is None:
                raise RequestRefused('a POST needs a Content-Length', 411)
            if request.content_length > MAX_BODY:
                raise RequestRefused(f'the body has {request.content_length} bytes: at most {MAX_BODY}', 413)
        host = request.headers.get('Host', '')
        if not self._allowed_host(host):
            raise RequestRefused(f'Host {host!r} is not this server\'s address (a reverse proxy must pass the Host '
                                 f'of --origin, or the address served)', 403)
        origin = request.headers.get('Origin')
        if origin is not None and origin.lower() not in (f'http://{host.lower()}', self.origin):
            raise RequestRefused(f'a request from {origin!r}: only this page may use the API', 403)
        if request.path.startswith('/api/') and request.headers.get('Sec-Fetch-Site') in ('cross-site', 'same-site'):
            raise RequestRefused('a request from another site: only this page may use the API', 403)
        if request.method == 'POST' and request.mimetype != 'application/json':
            raise RequestRefused(f'Content-Type {request.mimetype or "(none)"!r}: the API takes application/json',
                                 415)

    def on_page(self, request):
        return Response((PAGE_DIR / 'index.html').read_bytes(), mimetype='text/html',
                        headers={'Cache-Control': 'no-store'})

    def on_page_file(self, request, name):
        if name not in PAGE_FILES:  # only the page's own files: no path reaches anything else
            return _json(dict(error=f'no such file: {request.path}'), 404)
        return Response((PAGE_DIR / name).read_bytes(), mimetype=PAGE_FILES[name])

    def _body(self, request, *fields):
        """The JSON object of a POST (its size checked already), with fields present; strings where ids are."""
        try:
            body = json.loads(request.get_data(as_text=True) or 'null', parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            raise BadAnswer('the request body is not JSON (or nests too deep)') from None
        if not isinstance(body, dict):
            raise BadAnswer('the request body must be a JSON object')
        missing = [f for f in fields if f not in body]
        if missing:
            raise BadAnswer(f'the request body lacks {", ".join(missing)}')
        if 'key' in body and body['key'] is not None and not isinstance(body['key'], str):
            raise BadAnswer('key: expected the secret of your link, a string')
        return body

    def _labeler(self, store, values):
        if store is None:
            raise NotNow('no labeling session is open')
        return store.check_labeler(values.get('labeler'), values.get('key'))

    def _describe(self, store, question, order):
        texts = store.session['texts']
        encoder = self._encoders.get(texts['encoding'])
        if encoder is None:
            encoder = self._encoders[texts['encoding']] = encodings.get(texts['encoding']).get_encoder()
        return dict(id=question['id'], query_tokens=len(question['query']),
                    query=texts['query_prefix'] + encoder.decode(question['query']) + texts['query_suffix'],
                    responses=[encoder.decode(question[store.sample_keys[j]]) for j in order])

    def _session_info(self, store, labeler):
        instruction = store.session['instruction']
        # A rating question that says what its ends mean ("(1: none, 7: seven or more)") names the scale's ends;
        # else they are worst and best.
        ends = SCALE_ENDS.search(instruction) if store.label_key == 'score' else None
        return dict(label_type=store.label_type, label=store.label_key, instruction=instruction,
                    responses=len(store.sample_keys), labeler=labeler,
                    scale=dict(score=RATING_SCALE, difference=COMPARE_SCALE).get(store.label_key),
                    scale_ends=list(ends.groups()) if ends else None, progress=session_stats.progress(store, labeler))

    def on_next(self, request):
        store = self.store
        if store is None:
            return _json(dict(state='waiting', message=self.waiting))
        labeler = self._labeler(store, request.args)
        found = store.schedule.next_for(labeler)
        if found is None and not store.schedule.complete() and self.more_questions is not None:
            with self.making:
                found = store.schedule.next_for(labeler)
                if found is None and self.more_questions(store):
                    found = store.schedule.next_for(labeler)
        info = self._session_info(store, labeler)
        if found is None:
            if store.schedule.complete() or store.closed:
                return _json(dict(info, state='done', message='All the labels wanted are given. Thank you!'))
            if self.more_questions is None and not store.order:
                return _json(dict(info, state='empty', message='The first questions are being made (the model is '
                                                               'loading). This page looks again every few seconds.'))
            return _json(dict(info, state='empty', message='No question is open for you right now (the others are '
                                                           'with other labelers). This page looks again every few '
                                                           'seconds.'))
        question, order = found
        return _json(dict(info, state='question', question=self._describe(store, question, order)))

    def on_answer(self, request):
        body = self._body(request, 'question', 'choice')
        store = self.store
        labeler = self._labeler(store, body)
        store.answer(labeler, body['question'], body['choice'], client_seconds=body.get('seconds'))
        return _json(dict(ok=True, progress=session_stats.progress(store, labeler)))

    def on_skip(self, request):
        body = self._body(request, 'question')
        store = self.store
        labeler = self._labeler(store, body)
        store.skip(labeler, body['question'])
        return _json(dict(ok=True, progress=session_stats.progress(store, labeler)))

    def on_undo(self, request):
        body = self._body(request)
        store = self.store
        labeler = self._labeler(store, body)
        question = store.undo(labeler)
        return _json(dict(ok=True, question=question, progress=session_stats.progress(store, labeler)))

    def on_status(self, request):
        store = self.store
        if store is None:
            return _json(dict(state='waiting', message=self.waiting))
        if self.beyond_loopback:  # who labels and how much is the session's business: a named labeler's
            if store.session['labelers'] is None or 'labeler' not in request.args:
                raise WrongLabeler('off this machine the status is for the session\'s named labelers: '
                                   '?labeler=NAME&key=KEY of your link')
            self._labeler(store, request.args)
        return _json(dict(state='done' if store.schedule.complete() else 'open', progress=session_stats.progress(store),
                          agreement=session_stats.agreement(store), pi_beats_rho=session_stats.policy_wins(store),
                          labelers=session_stats.per_labeler(store),
                          session=os.path.basename(os.path.normpath(store.directory))))
