// The Kvasir playground: an editor of kvasir.dev resources, a sample
// request, and kvasirctl's validate / compile / explain run on them by the
// WebAssembly build of the same library (playground/src/lib.rs). Nothing
// here talks to a server: the only requests are the page's own files.
import init, * as kv from './pkg/kvasir_playground.js';
import { BUNDLE } from './examples.js';

const $ = (id) => document.getElementById(id);
const state = {
  files: [],          // [{name, text}]: the editor's tabs, in kvasirctl's reading order
  cur: 0,             // the tab shown
  diags: [],          // validate's errors and warnings (JSON), with `line` the text line
  targets: [],        // namespace/Kind/name
  pools: [],          // pool names of the compiled target
  sat: {},            // pool -> {on, value}: the pool state form
  view: 'cmd',        // which of kvasirctl's outputs is shown
  out: {},            // kvasirctl's outputs of the last run, by view
  example: null,
};

// ---------------------------------------------------------------- calls

function call(fn, extra) {
  const ns = $('namespace').value.trim();
  const c = { files: state.files, namespace: ns || null, ...extra };
  return JSON.parse(fn(JSON.stringify(c)));
}

function targetArgs() {
  // One target: kvasirctl picks it (no --target); several: the chosen one.
  if (state.targets.length < 2) return {};
  const t = $('target').value;
  return t ? { target: t.split('/').slice(1).join('/') } : {};
}

function request() {
  const v = (id) => $(id).value.trim();
  const r = { api: $('api').value };
  if (v('tenant')) r.tenant = v('tenant');
  if (v('api-key')) r.apiKey = v('api-key');
  const hs = $('headers').value.split('\n').map((l) => l.trim()).filter(Boolean);
  if (hs.length) r.headers = hs;
  if (v('jwt-claim')) r.jwtClaim = v('jwt-claim');
  if (v('model')) r.model = v('model');
  if (promptKind() === 'body') {
    if ($('body').value.trim()) r.body = $('body').value;
  } else if ($('prompt').value !== '') {
    r.prompt = $('prompt').value;
  }
  const sat = state.pools.filter((p) => state.sat[p] && state.sat[p].on).map((p) => `${p}=${state.sat[p].value}`);
  if (sat.length) r.saturation = sat;
  return r;
}

function promptKind() {
  return document.querySelector('input[name="prompt-kind"]:checked').value;
}

// ---------------------------------------------------------------- run

let timer = null;
function schedule() {
  clearTimeout(timer);
  timer = setTimeout(run, 150);
}

function run() {
  const t0 = performance.now();
  const allow = $('allow-missing').checked;
  const vj = call(kv.validate, { allowMissingSecrets: allow, output: 'json' });
  const vt = call(kv.validate, { allowMissingSecrets: allow, output: 'text' });
  state.out.validate = vt.stdout + vt.stderr;
  let report = null;
  try { report = JSON.parse(vj.stdout); } catch (e) { report = null; }
  const t1 = performance.now();
  renderDiagnostics(report, vt.stdout);
  const tsel = $('target').value;
  state.targets = report ? report.targets : [];
  fillSelect($('target'), state.targets, tsel);

  const cj = call(kv.compile, targetArgs());
  let config = null;
  state.out.config = cj.stdout || cj.stderr;
  if (cj.code === 0) config = JSON.parse(cj.stdout);
  if (config) fillForm(config);

  const req = request();
  const ej = call(kv.explain, { ...targetArgs(), request: req, output: 'json' });
  const et = call(kv.explain, { ...targetArgs(), request: req, output: 'text' });
  state.out.json = ej.stdout || ej.stderr;
  state.out.text = et.stdout || et.stderr;
  state.out.cmd = commandLine(req);
  const t2 = performance.now();
  renderExplain(ej);
  renderView();
  renderEditor();
  $('status').textContent = `validate ${(t1 - t0).toFixed(0)} ms · compile + explain ${(t2 - t1).toFixed(0)} ms`;
  $('status').className = 'status ok';
}

// ---------------------------------------------------------------- editor

function escapeHtml(s) {
  return s.replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' }[c]));
}

function fileDiags(name) {
  return state.diags.filter((d) => d.file === name && d.line);
}

function renderTabs() {
  const tabs = $('tabs');
  tabs.replaceChildren();
  state.files.forEach((f, i) => {
    const b = document.createElement('button');
    b.setAttribute('role', 'tab');
    b.className = 'tab' + (i === state.cur ? ' on' : '');
    const errs = fileDiags(f.name).filter((d) => d.severity === 'error').length;
    const warns = fileDiags(f.name).length - errs;
    b.textContent = f.name.split('/').pop();
    b.title = f.name;
    if (errs) b.dataset.errors = errs;
    else if (warns) b.dataset.warnings = warns;
    b.onclick = () => showFile(i);
    tabs.append(b);
  });
  const f = state.files[state.cur];
  $('file-name').value = f ? f.name : '';
}

function renderEditor() {
  renderTabs();
  const f = state.files[state.cur];
  const text = f ? f.text : '';
  const ta = $('text');
  if (ta.value !== text) ta.value = text;
  const byLine = new Map();
  for (const d of f ? fileDiags(f.name) : []) {
    if (!byLine.has(d.line)) byLine.set(d.line, []);
    byLine.get(d.line).push(d);
  }
  const lines = text.split('\n');
  const gutter = [];
  const mirror = [];
  lines.forEach((l, i) => {
    const n = i + 1;
    const ds = byLine.get(n);
    if (!ds) {
      gutter.push(`<div>${n}</div>`);
      mirror.push(escapeHtml(l));
      return;
    }
    const sev = ds.some((d) => d.severity === 'error') ? 'error' : 'warning';
    const title = escapeHtml(ds.map((d) => d.text).join('\n'));
    gutter.push(`<div class="mark ${sev}" data-line="${n}" title="${title}">${n}</div>`);
    const col = Math.max(1, Math.min(ds[0].column || 1, l.length + 1)) - 1;
    const at = l.slice(col, col + 1) || ' ';
    mirror.push(`<span class="line ${sev}" data-line="${n}" data-column="${col + 1}" title="${title}">`
      + `${escapeHtml(l.slice(0, col))}<span class="col">${escapeHtml(at)}</span>${escapeHtml(l.slice(col + 1))}</span>`);
  });
  $('gutter').innerHTML = gutter.join('');
  $('mirror').innerHTML = mirror.join('\n') + '\n ';
  syncScroll();
}

function syncScroll() {
  const ta = $('text');
  $('mirror').style.transform = `translate(${-ta.scrollLeft}px, ${-ta.scrollTop}px)`;
  $('gutter').style.transform = `translateY(${-ta.scrollTop}px)`;
}

function showFile(i) {
  state.cur = i;
  renderEditor();
}

function jumpTo(d) {
  const i = state.files.findIndex((f) => f.name === d.file);
  if (i < 0) return;
  showFile(i);
  const ta = $('text');
  const lines = ta.value.split('\n');
  let off = 0;
  for (let k = 0; k < d.line - 1 && k < lines.length; k++) off += lines[k].length + 1;
  off += Math.max(0, (d.column || 1) - 1);
  ta.focus();
  ta.setSelectionRange(off, off + 1);
  const lineH = parseFloat(getComputedStyle(ta).lineHeight) || 18;
  ta.scrollTop = Math.max(0, (d.line - 4) * lineH);
  syncScroll();
}

// ---------------------------------------------------------------- validate

function renderDiagnostics(report, text) {
  const ul = $('diagnostics');
  ul.replaceChildren();
  const badge = $('valid-badge');
  if (!report) {
    state.diags = [];
    badge.textContent = 'error';
    badge.className = 'badge bad';
    const li = document.createElement('li');
    li.textContent = text;
    ul.append(li);
    return;
  }
  const all = report.errors.concat(report.warnings);
  // kvasirctl's own lines, one a diagnostic, in the report's order.
  const lines = text.split('\n');
  state.diags = all.map((d, i) => ({ ...d, text: lines[i] }));
  for (const d of state.diags) {
    const li = document.createElement('li');
    li.className = d.severity;
    li.textContent = d.text;
    if (d.file) {
      li.tabIndex = 0;
      li.onclick = () => jumpTo(d);
      li.onkeydown = (e) => { if (e.key === 'Enter') jumpTo(d); };
    }
    ul.append(li);
  }
  const last = document.createElement('li');
  last.className = 'summary';
  last.textContent = lines[all.length] || '';
  ul.append(last);
  const nErr = report.errors.length;
  badge.textContent = nErr ? `${nErr} error${nErr > 1 ? 's' : ''}` : 'valid';
  badge.className = 'badge ' + (nErr ? 'bad' : 'good');
}

// ---------------------------------------------------------------- the form

function fillSelect(sel, values, keep) {
  const cur = [...sel.options].map((o) => o.value).join('\n');
  if (cur !== values.join('\n')) {
    sel.replaceChildren(...values.map((v) => new Option(v, v)));
  }
  if (values.includes(keep)) sel.value = keep;
}

function fillList(list, values) {
  list.replaceChildren(...values.map((v) => new Option(v)));
}

function fillForm(config) {
  fillList($('tenant-names'), (config.tenants || []).map((t) => t.name));
  const models = new Set();
  for (const p of config.pools || []) for (const m of p.models || []) models.add(m);
  fillList($('model-names'), [...models]);
  const pools = (config.pools || []).map((p) => p.name);
  if (pools.join('\n') === state.pools.join('\n')) return;
  state.pools = pools;
  const box = $('pools');
  box.replaceChildren();
  const h = document.createElement('div');
  h.className = 'pools-title';
  h.textContent = 'pool state (saturation as the indexer reports it; unset: unknown)';
  box.append(h);
  for (const p of pools) {
    const s = state.sat[p] || (state.sat[p] = { on: false, value: '0.5' });
    const row = document.createElement('div');
    row.className = 'pool';
    row.innerHTML = `<label><input type="checkbox" data-pool="${escapeHtml(p)}"> ${escapeHtml(p)}</label>`
      + `<input type="range" min="0" max="1" step="0.01" data-pool="${escapeHtml(p)}">`
      + `<output></output>`;
    const [cb, range, out] = [row.querySelector('input[type=checkbox]'), row.querySelector('input[type=range]'), row.querySelector('output')];
    cb.checked = s.on;
    range.value = s.value;
    range.disabled = !s.on;
    out.textContent = s.on ? s.value : 'unknown';
    cb.onchange = () => { s.on = cb.checked; range.disabled = !s.on; out.textContent = s.on ? s.value : 'unknown'; schedule(); };
    range.oninput = () => { s.value = range.value; out.textContent = s.value; schedule(); };
    box.append(row);
  }
}

function syncPools() {
  for (const row of $('pools').querySelectorAll('.pool')) {
    const cb = row.querySelector('input[type=checkbox]');
    const s = state.sat[cb.dataset.pool];
    const range = row.querySelector('input[type=range]');
    cb.checked = s.on;
    range.value = s.value;
    range.disabled = !s.on;
    row.querySelector('output').textContent = s.on ? s.value : 'unknown';
  }
}

// ---------------------------------------------------------------- explain

const RESULT = {
  decided: ['decides', 'good'],
  notMatched: ['did not match', 'muted'],
  skippedForPii: ['matched, skipped: PII', 'warn'],
  notReached: ['not reached', 'muted'],
};

function code(s) {
  const c = document.createElement('code');
  c.textContent = s;
  return c;
}

function sentence(d) {
  // What the filter does, in words, from the decision kvasirctl prints.
  switch (d.action) {
    case 'route': {
      const h = d.hints || {};
      const parts = [`Route to pool ${d.pool} (x-kvasir-cluster: ${d.cluster}): the cache-indexer's pool `
        + `${h.indexerPool} picks the engine that holds the longest prefix, weighed against load`];
      parts.push(`priority ${h.priority}, fair-share weight ${h.weight}`
        + (h.maxQueueWaitMs ? `, waiting at most ${h.maxQueueWaitMs} ms in the pool's queue when saturated` : ', no queueing'));
      if (d.rewriteModel) parts.push(`the body's model is rewritten to ${d.rewriteModel}`);
      if (d.includeUsage) parts.push('streams ask for usage (stream_options.include_usage)');
      return parts.join('; ') + '.';
    }
    case 'provider':
      return `Send to the external provider ${d.provider} (x-kvasir-cluster: ${d.cluster}`
        + (d.authority ? `, host ${d.authority}` : '') + ')'
        + (d.model ? `, as model ${d.model}` : '') + '; the gateway adds its credential.';
    case 'reject':
      return `Answer ${d.status} without reaching an engine: ${d.message}.`;
    case 'shed':
      return `Answer 429 with Retry-After: ${d.retryAfterS} s, without reaching an engine: ${d.message}.`;
    default:
      return JSON.stringify(d);
  }
}

function renderExplain(ej) {
  const box = $('explain');
  box.replaceChildren();
  const badge = $('decision-badge');
  if (ej.code !== 0) {
    badge.textContent = ej.code === 1 ? 'does not compile' : 'usage';
    badge.className = 'badge bad';
    const pre = document.createElement('pre');
    pre.className = 'stderr';
    pre.textContent = ej.stderr;
    box.append(pre);
    return;
  }
  const e = JSON.parse(ej.stdout);
  const d = e.decision;
  badge.textContent = d.action === 'route' ? `route → ${d.pool}` : d.action === 'provider' ? `provider → ${d.provider}`
    : `${d.action} ${d.status}`;
  badge.className = 'badge ' + (d.action === 'route' || d.action === 'provider' ? 'good' : 'bad');

  const r = e.request;
  const facts = document.createElement('p');
  facts.className = 'facts';
  const fact = (k, v) => { const s = document.createElement('span'); s.append(`${k} `, code(String(v))); facts.append(s); };
  fact('target', e.target);
  fact('tenant', r.tenant === null ? '(none)' : `${r.tenant} (by ${r.tenantVia})`);
  fact('api', r.api);
  fact('model', r.model);
  fact('≈ prompt tokens', r.estimatedPromptTokens);
  if (r.pii !== undefined && r.pii !== null) fact('PII', r.pii.length ? r.pii.join(', ') : 'none');
  if (r.easy !== undefined && r.easy !== null) fact('easy', r.easy);
  box.append(facts);

  if (e.policies.length) {
    const table = document.createElement('table');
    table.className = 'policies';
    table.innerHTML = '<thead><tr><th>#</th><th>policy</th><th>result</th><th>why</th></tr></thead>';
    const tb = document.createElement('tbody');
    e.policies.forEach((p, i) => {
      const tr = document.createElement('tr');
      const [label, cls] = RESULT[p.result] || [p.result, ''];
      tr.className = cls;
      tr.dataset.result = p.result;
      const why = p.result === 'notMatched'
        ? (p.failed.length ? `${p.failed.join(', ')} not met` : 'no condition holds')
        : p.result === 'skippedForPii' ? 'a provider action, and the request has PII inside a PII guard\'s scope'
          : p.result === 'notReached' ? 'an earlier policy decided' : 'every condition holds';
      tr.innerHTML = `<td>${i + 1}</td><td></td><td></td><td></td>`;
      tr.children[1].append(code(p.name));
      tr.children[2].textContent = label;
      tr.children[3].textContent = why;
      tb.append(tr);
    });
    table.append(tb);
    box.append(table);
  }
  const by = document.createElement('p');
  by.className = 'decided';
  const who = e.decidedBy === 'policy' ? `policy ${e.policy}`
    : e.decidedBy === 'piiGuardFallback' ? `PII guard ${e.policy} (the default would send PII to a provider)`
      : e.decidedBy === 'tenant' ? 'tenant identification: no policy ran' : 'the default action: no policy matched';
  by.append('decided by ', code(who));
  box.append(by);
  const what = document.createElement('p');
  what.className = 'what';
  what.id = 'what';
  what.textContent = sentence(d);
  box.append(what);
}

// ---------------------------------------------------------------- kvasirctl's outputs

function sh(s) {
  return /^[A-Za-z0-9_./:=@+-]+$/.test(s) ? s : `'${s.replace(/'/g, `'\\''`)}'`;
}

function commandLine(r) {
  const a = ['kvasirctl', 'explain', ...state.files.map((f) => f.name)];
  const ns = $('namespace').value.trim();
  if (ns) a.push('--namespace', ns);
  const t = targetArgs().target;
  if (t) a.push('--target', t);
  if (r.tenant) a.push('--tenant', r.tenant);
  if (r.apiKey) a.push('--api-key', r.apiKey);
  for (const h of r.headers || []) a.push('-H', h);
  if (r.jwtClaim) a.push('--jwt-claim', r.jwtClaim);
  if (r.model) a.push('--model', r.model);
  a.push('--api', r.api);
  if (r.body !== undefined) a.push('--body', 'body.json');
  if (r.prompt !== undefined) a.push('--prompt', r.prompt);
  for (const s of r.saturation || []) a.push('--saturation', s);
  let out = a.map(sh).join(' ');
  if (r.body !== undefined) out += '\n\n# body.json holds the body above';
  if (state.example && state.example.edited) out += '\n# the files as edited here (save each tab under its name)';
  return out;
}

function renderView() {
  for (const b of document.querySelectorAll('.viewtabs button')) b.classList.toggle('on', b.dataset.view === state.view);
  $('view').textContent = state.out[state.view] || '';
}

// ---------------------------------------------------------------- examples

function renderExamples() {
  const nav = $('examples');
  for (const set of BUNDLE.sets) {
    const g = document.createElement('div');
    g.className = 'set';
    const t = document.createElement('span');
    t.className = 'set-title';
    t.textContent = set.title;
    t.title = [set.note, ...set.files].filter(Boolean).join('\n');
    g.append(t);
    for (const ex of BUNDLE.examples.filter((x) => x.set === set.id)) {
      const b = document.createElement('button');
      b.textContent = ex.title;
      b.dataset.example = ex.id;
      b.onclick = () => loadExample(ex.id);
      g.append(b);
    }
    nav.append(g);
  }
}

function loadExample(id) {
  const ex = BUNDLE.examples.find((x) => x.id === id);
  const set = BUNDLE.sets.find((s) => s.id === ex.set);
  state.example = { id, edited: false };
  state.files = set.files.map((name) => ({ name, text: BUNDLE.texts[name] }));
  state.cur = Math.max(0, set.files.indexOf(ex.focus));
  const r = ex.request;
  $('namespace').value = '';
  $('allow-missing').checked = false;
  $('tenant').value = r.tenant || '';
  $('api-key').value = r.apiKey || '';
  $('headers').value = (r.headers || []).join('\n');
  $('jwt-claim').value = r.jwtClaim || '';
  $('model').value = r.model || '';
  $('api').value = r.api || 'chat';
  const kind = r.body !== undefined ? 'body' : 'prompt';
  document.querySelector(`input[name="prompt-kind"][value="${kind}"]`).checked = true;
  showPromptKind();
  $('prompt').value = r.prompt || '';
  $('body').value = r.body !== undefined ? r.body : '';
  for (const p of Object.keys(state.sat)) state.sat[p].on = false;
  for (const s of r.saturation || []) {
    const [p, v] = s.split('=');
    state.sat[p] = { on: true, value: v };
  }
  syncPools();
  for (const b of document.querySelectorAll('#examples button')) b.classList.toggle('on', b.dataset.example === id);
  run();
}

function showPromptKind() {
  const body = promptKind() === 'body';
  $('body').hidden = !body;
  $('prompt').hidden = body;
}

// ---------------------------------------------------------------- wiring

function edited() {
  if (state.example) state.example.edited = true;
  schedule();
}

function wire() {
  const ta = $('text');
  ta.addEventListener('input', () => {
    state.files[state.cur].text = ta.value;
    renderEditor();
    edited();
  });
  ta.addEventListener('scroll', syncScroll);
  ta.addEventListener('keydown', (e) => {
    if (e.key === 'Tab' && !e.shiftKey && !e.ctrlKey && !e.metaKey) {
      e.preventDefault();
      ta.setRangeText('  ', ta.selectionStart, ta.selectionEnd, 'end');
      ta.dispatchEvent(new Event('input'));
    }
  });
  $('file-name').addEventListener('change', () => {
    const n = $('file-name').value.trim();
    if (n && state.files[state.cur]) { state.files[state.cur].name = n; renderTabs(); edited(); }
  });
  $('add-file').onclick = () => {
    let k = 1;
    while (state.files.some((f) => f.name === `untitled-${k}.yaml`)) k++;
    state.files.push({ name: `untitled-${k}.yaml`, text: '' });
    state.cur = state.files.length - 1;
    renderEditor();
    $('text').focus();
    edited();
  };
  $('remove-file').onclick = () => {
    if (!state.files.length) return;
    state.files.splice(state.cur, 1);
    state.cur = Math.max(0, state.cur - 1);
    renderEditor();
    edited();
  };
  // --tenant and --api-key exclude each other, as on the command line.
  $('tenant').addEventListener('input', () => { if ($('tenant').value) $('api-key').value = ''; });
  $('api-key').addEventListener('input', () => { if ($('api-key').value) $('tenant').value = ''; });
  for (const id of ['namespace', 'allow-missing', 'target', 'api', 'tenant', 'api-key', 'headers', 'jwt-claim', 'model', 'prompt', 'body']) {
    $(id).addEventListener('input', schedule);
    $(id).addEventListener('change', schedule);
  }
  for (const r of document.querySelectorAll('input[name="prompt-kind"]')) {
    r.addEventListener('change', () => { showPromptKind(); schedule(); });
  }
  for (const b of document.querySelectorAll('.viewtabs button')) {
    b.onclick = () => { state.view = b.dataset.view; renderView(); };
  }
  $('request').addEventListener('submit', (e) => e.preventDefault());
}

async function main() {
  try {
    await init();
  } catch (e) {
    $('status').textContent = `the module did not load: ${e}`;
    $('status').className = 'status bad';
    throw e;
  }
  $('version').textContent = kv.version();
  renderExamples();
  wire();
  loadExample(BUNDLE.examples[0].id);
  // For tests and the curious: when the page was first usable.
  window.kvasirReadyMs = performance.now();
  document.body.dataset.ready = '1';
}

main();
