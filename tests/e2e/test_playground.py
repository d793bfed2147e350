"""The playground (playground/) in a real browser: Debian's Chromium driven
by playwright-core (tests/e2e/playground_browser.mjs), the page served from
the built site on 127.0.0.1.

- the page loads, the module is under 1 MB gzipped, nothing but the
  page's own files is ever requested;
- a broken policy pasted into the editor shows kvasirctl's diagnostics,
  marked at their line and column;
- every bundled example gives, byte for byte, what `kvasirctl explain`
  (text and `-o json`), `validate` and `compile` print for the same files
  and flags;
- a screenshot for the README (target/playground-screenshot.png; with
  KVASIR_UPDATE_SCREENSHOT=1 also playground/screenshot.png).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kvasir_harness import REPO, TARGET, cargo, load_script

site_mod = load_script(REPO / "playground" / "playground.py", "kvasir_playground_site")

KVASIRCTL = TARGET / "release" / "kvasirctl"
NODE_DIR = Path(os.environ.get("KVASIR_NODE_DIR", REPO / ".tools" / "node"))
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
DRIVER = Path(__file__).with_name("playground_browser.mjs")
BROKEN = "cli/tests/fixtures/broken.yaml"
SCREENSHOT_EXAMPLE = "crds-burst"
MANIFEST = json.loads((REPO / "playground" / "examples.json").read_text())
EXAMPLES = {e["id"]: e for e in MANIFEST["examples"]}
SETS = {s["id"]: s for s in MANIFEST["sets"]}


@pytest.fixture(scope="module")
def site():
    for what, p in (("Debian's chromium", CHROMIUM), ("node", shutil.which("node")),
                    ("playwright-core", NODE_DIR / "node_modules" / "playwright-core")):
        if not p or not Path(p).exists():
            pytest.fail(f"{what} is missing: run `make setup`")
    sizes = site_mod.build(quiet=True)
    cargo("build", "--release", "-q", "-p", "kvasirctl")
    httpd = site_mod.server(0)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", sizes
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory):
    url, sizes = site
    d = tmp_path_factory.mktemp("playground")
    shot = TARGET / "playground-screenshot.png"
    spec = {
        "url": url,
        "examples": list(EXAMPLES),
        "broken": {"name": BROKEN, "text": (REPO / BROKEN).read_text()},
        "screenshot": {"path": str(shot), "example": SCREENSHOT_EXAMPLE},
    }
    (d / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run(["node", str(DRIVER), str(d / "spec.json")], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "KVASIR_NODE_DIR": str(NODE_DIR), "CHROMIUM": str(CHROMIUM)})
    assert p.returncode == 0, f"the browser driver failed:\n{p.stderr[-4000:]}"
    out = json.loads(p.stdout)
    out["sizes"] = sizes
    out["screenshot"] = shot
    print(f"\nplayground: module {sizes['wasm']} B ({sizes['wasm_gzip']} B gzip); page usable "
          f"{out['readyMs']:.0f} ms after navigation start (load event {out['navigation']['load']:.0f} ms)")
    return out


def kvasirctl(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVASIRCTL), *args], cwd=REPO, capture_output=True, text=True, timeout=30)


def explain_flags(r: dict, body_file: Path) -> list[str]:
    """The sample request as kvasirctl's flags (the page's request form)."""
    a: list[str] = []
    if "tenant" in r:
        a += ["--tenant", r["tenant"]]
    if "apiKey" in r:
        a += ["--api-key", r["apiKey"]]
    for h in r.get("headers", []):
        a += ["-H", h]
    if "jwtClaim" in r:
        a += ["--jwt-claim", r["jwtClaim"]]
    if "model" in r:
        a += ["--model", r["model"]]
    a += ["--api", r.get("api", "chat")]
    if "body" in r:
        body_file.write_text(r["body"])
        a += ["--body", str(body_file)]
    if "prompt" in r:
        a += ["--prompt", r["prompt"]]
    for s in r.get("saturation", []):
        a += ["--saturation", s]
    return a


def test_the_page_loads_small_and_fast(browser):
    assert browser["console"] == [], browser["console"]
    assert browser["sizes"]["wasm_gzip"] < 1_000_000, browser["sizes"]
    # Generous: a loaded 2-core machine; typical is about 300 ms.
    assert browser["readyMs"] < 10_000, browser["readyMs"]


def test_nothing_leaves_the_page(browser, site):
    origin = urlparse(site[0]).netloc
    for r in browser["requests"]:
        assert r["method"] == "GET" and urlparse(r["url"]).netloc == origin, r
    # Once loaded, running every example and editing made no request at all.
    assert [r for r in browser["requests"] if r["phase"] != "load"] == []
    assert {urlparse(r["url"]).path for r in browser["requests"]} == {
        "/", "/style.css", "/app.js", "/examples.js", "/pkg/kvasir_playground.js", "/pkg/kvasir_playground_bg.wasm"}


def test_a_pasted_broken_policy_is_marked_at_its_line(browser):
    b = browser["broken"]
    cli = kvasirctl(["validate", BROKEN])
    assert cli.returncode == 1
    # kvasirctl's own lines, in its order: file:line:col: error: Kind/name: path: message.
    assert b["diagnostics"] == cli.stdout.splitlines()
    assert b["diagnostics"][0].startswith(f"{BROKEN}:17:5: error: InferencePolicy/typo: spec.match.modle: unknown field")
    assert [(g["line"], g["cls"]) for g in b["gutter"]] == [(17, "mark error"), (34, "mark error")]
    assert [(m["line"], m["column"], m["at"]) for m in b["marks"]] == [(17, 5, "m"), (34, 7, "p")]
    assert b["marks"][0]["text"] == "    modle: oops"
    assert b["badge"] == "2 errors"
    assert b["tab"] == {"title": BROKEN, "errors": "2"}
    assert b["caret"] == {"line": 17, "column": 5}


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_every_example_is_what_kvasirctl_prints(browser, example, tmp_path):
    ex = EXAMPLES[example]
    page = browser["examples"][example]
    files = SETS[ex["set"]]["files"]
    flags = explain_flags(ex["request"], tmp_path / "body.json")
    as_json = kvasirctl(["explain", *files, *flags, "-o", "json"])
    as_text = kvasirctl(["explain", *files, *flags])
    assert as_json.returncode == 0, as_json.stderr
    assert page["json"] == as_json.stdout
    assert page["text"] == as_text.stdout
    assert page["validate"] == kvasirctl(["validate", *files]).stdout
    assert page["compile"] == kvasirctl(["compile", *files]).stdout
    # The rendered explanation says the same: each policy's result, the action.
    e = json.loads(as_json.stdout)
    assert page["rows"] == [{"name": p["name"], "result": p["result"]} for p in e["policies"]]
    action = e["decision"]["action"]
    assert page["badge"].startswith(action), (page["badge"], action)
    assert page["command"].startswith("kvasirctl explain " + " ".join(files))


def test_the_examples_show_each_kind_of_decision(browser):
    actions = {json.loads(v["json"])["decision"]["action"] for v in browser["examples"].values()}
    assert actions == {"route", "provider", "reject", "shed"}
    by = {json.loads(v["json"])["policy"] for v in browser["examples"].values()}
    assert {"pii-stays-inside", "burst-to-provider", "cheaper-model-for-easy-prompts", "batch-when-idle",
            "batch-waits"} <= by


def test_a_screenshot_for_the_readme(browser):
    shot: Path = browser["screenshot"]
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) < 400_000, len(data)
    if os.environ.get("KVASIR_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, REPO / "playground" / "screenshot.png")
