// Drives the playground in Debian's Chromium through playwright-core (from
// .tools/node, never a downloaded browser) for tests/e2e/test_playground.py.
//
//   node tests/e2e/playground_browser.mjs SPEC.json
//
// SPEC: {url, examples: [id], broken: {name, text}, screenshot: {path, example}}.
// Prints one JSON object: load timings, each example's outputs as the page
// shows them, the broken file's diagnostics and marks, every request the
// page made.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
const require = createRequire(path.join(process.env.KVASIR_NODE_DIR || path.join(repo, '.tools', 'node'), 'package.json'));
const { chromium } = require('playwright-core');

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const STEP_MS = 15000;

// As root with no network (docs: FACTS, "Browser tests"): no sandbox, no GPU,
// nothing in the background that would try to reach the internet.
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  timeout: 30000,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
const out = { requests: [], console: [], examples: {} };
try {
  const ctx = await browser.newContext({ viewport: { width: 1360, height: 960 }, deviceScaleFactor: 1 });
  const page = await ctx.newPage();
  page.setDefaultTimeout(STEP_MS);
  page.on('request', (r) => out.requests.push({ method: r.method(), url: r.url(), phase: out.phase || 'load' }));
  page.on('console', (m) => { if (m.type() === 'error') out.console.push(m.text()); });
  page.on('pageerror', (e) => out.console.push(String(e)));

  const t0 = Date.now();
  await page.goto(spec.url, { waitUntil: 'load' });
  await page.waitForSelector('body[data-ready="1"]');
  out.loadWallMs = Date.now() - t0;
  out.readyMs = await page.evaluate(() => window.kvasirReadyMs);
  out.navigation = await page.evaluate(() => {
    const n = performance.getEntriesByType('navigation')[0];
    return { domContentLoaded: n.domContentLoadedEventEnd, load: n.loadEventEnd };
  });
  out.phase = 'use';

  await page.click('#views summary');
  const view = async (v) => {
    await page.click(`.viewtabs button[data-view="${v}"]`);
    return page.$eval('#view', (e) => e.textContent);
  };
  for (const id of spec.examples) {
    await page.click(`button[data-example="${id}"]`);
    await page.waitForSelector(`#examples button.on[data-example="${id}"]`);
    out.examples[id] = {
      json: await view('json'),
      text: await view('text'),
      validate: await view('validate'),
      compile: await view('config'),
      command: await view('cmd'),
      rows: await page.$$eval('table.policies tbody tr', (rs) => rs.map((r) => ({
        name: r.children[1].textContent, result: r.dataset.result }))),
      what: await page.$eval('#explain', (e) => (e.querySelector('#what') || e).textContent),
      badge: await page.$eval('#decision-badge', (e) => e.textContent),
    };
  }

  if (spec.broken) {
    while (await page.$$eval('#tabs .tab', (t) => t.length)) await page.click('#remove-file');
    await page.click('#add-file');
    await page.fill('#file-name', spec.broken.name);
    await page.press('#file-name', 'Enter');
    await page.click('#text');
    await page.keyboard.insertText(spec.broken.text);  // as a paste does
    await page.waitForSelector('#gutter .mark.error');
    await page.waitForFunction(() => document.querySelector('#valid-badge').textContent.includes('error'));
    out.broken = {
      diagnostics: await page.$$eval('#diagnostics li', (ls) => ls.map((l) => l.textContent)),
      gutter: await page.$$eval('#gutter .mark', (ms) => ms.map((m) => ({ line: +m.dataset.line, cls: m.className }))),
      marks: await page.$$eval('#mirror .line', (ls) => ls.map((l) => ({
        line: +l.dataset.line, column: +l.dataset.column, text: l.textContent, at: l.querySelector('.col').textContent }))),
      badge: await page.$eval('#valid-badge', (e) => e.textContent),
      tab: await page.$eval('#tabs .tab.on', (e) => ({ title: e.title, errors: e.dataset.errors })),
    };
    // A click on a diagnostic puts the caret at its line and column.
    await page.click('#diagnostics li.error');
    out.broken.caret = await page.$eval('#text', (t) => {
      const before = t.value.slice(0, t.selectionStart).split('\n');
      return { line: before.length, column: before[before.length - 1].length + 1 };
    });
  }

  if (spec.screenshot) {
    await page.click(`button[data-example="${spec.screenshot.example}"]`);
    await page.waitForSelector(`#examples button.on[data-example="${spec.screenshot.example}"]`);
    await page.click('#views summary');  // closed: the screenshot shows the page, not the raw outputs
    await page.evaluate(() => { window.scrollTo(0, 0); document.activeElement.blur(); });
    await page.screenshot({ path: spec.screenshot.path, fullPage: false });
  }
  await ctx.close();
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(out));
