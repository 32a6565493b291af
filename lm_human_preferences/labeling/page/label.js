// The labeling page: asks the server for the next question, shows it, sends the answer (server.py's API).
// Keys: 1..N pick (or a point of the scale), s skips, u undoes the last answer, ? shows the help.
'use strict';

const params = new URLSearchParams(location.search);
const who = { labeler: params.get('labeler'), key: params.get('key') };
let current = null;      // the /api/next reply being shown
let shownAt = 0;         // when the question was drawn (performance.now())
let busy = false;        // a request is in flight: keys and clicks wait for it
let pollTimer = null;
const POLL_MS = 3000;    // how often a page with nothing to show (or no server) looks again

const $ = (id) => document.getElementById(id);

function query() {
  const q = new URLSearchParams({ labeler: who.labeler || '' });
  if (who.key) q.set('key', who.key);
  return q.toString();
}

async function call(method, path, body) {
  const options = { method, headers: {} };
  if (body !== undefined) {
    options.headers['Content-Type'] = 'application/json';
    options.body = JSON.stringify(Object.assign({ labeler: who.labeler, key: who.key }, body));
  }
  let reply;
  try {
    reply = await fetch(path, options);
  } catch (e) {  // the browser's own words ("Failed to fetch") say nothing to a labeler
    const error = new Error('The labeling server cannot be reached (stopped, or starting again): this page tries ' +
                            'again every few seconds.');
    error.network = true;
    throw error;
  }
  let data;
  try { data = await reply.json(); } catch (e) { data = { error: `the server answered ${reply.status}` }; }
  if (!reply.ok) throw new Error(data.error || `the server answered ${reply.status}`);
  return data;
}

function banner(text) {
  $('banner').textContent = text || '';
  $('banner').hidden = !text;
}

function showProgress(p) {
  if (!p) return;
  $('progress').textContent = `${p.done} / ${p.target} labels done · you: ${p.mine} answered` +
    (p.skipped ? `, ${p.skipped} skipped` : '');
  $('bar-done').style.width = `${Math.min(100, (100 * p.done) / Math.max(1, p.target))}%`;
}

function scalePoints(info) {
  // [value sent, key, what it means]
  const [low, high] = info.scale;
  const points = [];
  for (let v = low, k = 1; v <= high; v++, k++) {
    let what = '';
    if (info.label === 'score') {
      const [worst, best] = info.scale_ends || ['worst', 'best'];
      what = v === low ? worst : v === high ? best : '';
    }
    else what = v === 0 ? 'about the same' :
      `${v < 0 ? 'A' : 'B'} ${['slightly better', 'better', 'much better'][Math.min(Math.abs(v), 3) - 1]}`;
    points.push([v, String(k), what]);
  }
  return points;
}

function helpKeys(info) {
  const keys = [];
  if (info.label === 'best') keys.push(`<kbd>1</kbd>…<kbd>${info.responses}</kbd> or a click: pick that response`);
  else keys.push(`<kbd>1</kbd>…<kbd>${info.scale[1] - info.scale[0] + 1}</kbd> or a click: that point of the scale`);
  keys.push('<kbd>s</kbd> skip this question', '<kbd>u</kbd> undo your last answer (or skip)',
            '<kbd>?</kbd> this help');
  $('help-keys').innerHTML = keys.map((k) => `<li>${k}</li>`).join('');
}

function render(data) {
  current = data;
  clearTimeout(pollTimer);
  if (data.instruction) {
    $('instruction').textContent = data.instruction;
    $('help-instruction').textContent = data.instruction;
    helpKeys(data);
  } else if (data.state === 'waiting') {
    $('instruction').textContent = 'Waiting for questions';
  }
  $('labeler').textContent = who.labeler ? `labeler: ${who.labeler}` : '';
  showProgress(data.progress);
  if (data.state !== 'question') {
    $('question').hidden = true;
    $('state').hidden = false;
    $('state').textContent = data.message;
    if (data.state !== 'done') pollTimer = setTimeout(next, POLL_MS);
    return;
  }
  const q = data.question;
  $('state').hidden = true;
  $('question').hidden = false;
  $('question').dataset.id = q.id;
  $('query').textContent = q.query;
  // A query is all the model saw, a few tokens of a passage at times: the labeler judges the continuation of this.
  $('query-note').textContent = `all the model saw: ${q.query_tokens} tokens (judge the responses as ` +
    'continuations of this alone)';
  const list = $('responses');
  list.innerHTML = '';
  const letters = data.label === 'difference';
  $('responses-title').textContent = q.responses.length === 1 ? 'Continuation' : 'Continuations';
  q.responses.forEach((text, i) => {
    const li = document.createElement('li');
    const button = document.createElement('button');
    button.type = 'button';
    button.className = 'response';
    button.dataset.position = String(i);
    const key = document.createElement('span');
    key.className = 'key';
    key.textContent = letters ? 'AB'[i] : q.responses.length === 1 ? '·' : String(i + 1);
    const body = document.createElement('span');
    body.className = 'body';
    if (text.trim()) body.textContent = text; else { body.textContent = '(empty)'; body.classList.add('empty'); }
    button.append(key, body);
    if (data.label === 'best') button.addEventListener('click', () => answer(i));
    else button.disabled = true;
    li.append(button);
    list.append(li);
  });
  const scale = $('scale');
  scale.innerHTML = '';
  scale.hidden = data.label === 'best';
  if (data.label !== 'best') {
    for (const [value, key, what] of scalePoints(data)) {
      const b = document.createElement('button');
      b.type = 'button';
      b.dataset.value = String(value);
      b.innerHTML = `<span class="key">${key}</span><span class="what"></span>`;
      b.querySelector('.what').textContent = what || String(value);
      b.addEventListener('click', () => answer(value));
      scale.append(b);
    }
  }
  shownAt = performance.now();
}

async function run(action) {
  if (busy) return;
  busy = true;
  try {
    await action();
    banner('');
  } catch (e) {
    banner(e.message);
    // A failed request must not end the page's looking: it asks for its question again (after a server
    // restart, the question it shows is no longer held for this labeler).
    if (e.network || !current || current.state !== 'question') {
      clearTimeout(pollTimer);
      pollTimer = setTimeout(next, POLL_MS);
    }
  } finally {
    busy = false;
  }
}

function next() {
  return run(async () => render(await call('GET', `/api/next?${query()}`)));
}

function answer(choice) {
  if (!current || current.state !== 'question') return;
  const id = current.question.id;
  if (current.label === 'best') {
    const chosen = document.querySelector(`#responses button[data-position="${choice}"]`);
    if (chosen) chosen.classList.add('chosen');
  }
  const seconds = (performance.now() - shownAt) / 1000;
  return run(async () => {
    try {
      await call('POST', '/api/answer', { question: id, choice, seconds });
    } finally {
      render(await call('GET', `/api/next?${query()}`));
    }
  });
}

function skip() {
  if (!current || current.state !== 'question') return;
  const id = current.question.id;
  return run(async () => {
    await call('POST', '/api/skip', { question: id });
    render(await call('GET', `/api/next?${query()}`));
  });
}

function undo() {
  return run(async () => {
    await call('POST', '/api/undo', {});
    render(await call('GET', `/api/next?${query()}`));
  });
}

function toggleHelp(show) {
  $('help').hidden = show === undefined ? !$('help').hidden : !show;
}

document.addEventListener('keydown', (event) => {
  if (event.ctrlKey || event.metaKey || event.altKey) return;
  const target = event.target;
  if (target.isContentEditable || ['INPUT', 'TEXTAREA', 'SELECT'].includes(target.tagName)) return;  // typing
  if (event.key === '?') { toggleHelp(); event.preventDefault(); return; }
  if (event.key === 'Escape') { toggleHelp(false); return; }
  if (!$('help').hidden) return;
  if (event.key === 's') { skip(); return; }
  if (event.key === 'u') { undo(); return; }
  if (!current || current.state !== 'question' || !/^[1-9]$/.test(event.key)) return;
  const k = Number(event.key);
  if (current.label === 'best') {
    if (k <= current.question.responses.length) answer(k - 1);
  } else {
    const points = scalePoints(current);
    if (k <= points.length) answer(points[k - 1][0]);
  }
});

$('help-button').addEventListener('click', () => toggleHelp());
$('help').addEventListener('click', (event) => { if (event.target === $('help')) toggleHelp(false); });
$('skip').addEventListener('click', skip);
$('undo').addEventListener('click', undo);

if (!who.labeler) {
  // An open session: a labeler names themselves once (the name goes into the link).
  $('instruction').textContent = 'Who is labeling?';
  $('state').hidden = false;
  $('state').innerHTML = '<form id="name-form"><label>Your name (letters, digits, _ . -): ' +
    '<input id="name" name="labeler" required pattern="[A-Za-z0-9_.\\-]{1,40}" autofocus></label> ' +
    '<button type="submit">Start</button></form>';
} else {
  next();
}
