"""The session's log scan (conftest.py's `no_secret_in_logs`,
harness/kvasir_harness/secret_scan.py): it is installed in this session,
knows the suite's secrets, and names the file and line of each it finds.
Nothing here writes a secret to a process's log (that would fail the
session, as it should)."""

from __future__ import annotations

import os

from kvasir_harness import KEYS, PROVIDER_KEY, Proc, secret_scan


def test_the_scan_names_file_and_line(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(f"start\nok\nauthorization: Bearer {KEYS['acme']}\nfine\n{PROVIDER_KEY} again\n")
    found = secret_scan.scan(log, {KEYS["acme"]: "API key of tenant acme", PROVIDER_KEY: "the provider key"})
    assert found == [f"{log}:3: API key of tenant acme appears", f"{log}:5: the provider key appears"]
    assert secret_scan.scan(tmp_path / "gone.log", {KEYS["acme"]: "k"}) == []


def test_the_suites_keys_are_known():
    known = secret_scan.secrets()
    for k in [*KEYS.values(), PROVIDER_KEY, "sk-acme-example-1", "sk-eval-example", "sk-wrong"]:
        assert k in known, k


def test_every_process_is_registered_and_its_token_collected(tmp_path):
    """A process started through the harness is registered (its log will be
    scanned), and the indexer token beside its log is one of the secrets."""
    token = os.urandom(16).hex()
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "indexer-token").write_text(token)
    before = secret_scan.logs_seen()
    p = Proc("quiet", ["true"], tmp_path)
    try:
        assert secret_scan.logs_seen() == before + 1, "conftest.py installed the scan"
        assert secret_scan.secrets()[token] == "the indexer token"
    finally:
        p.stop()
    assert secret_scan.scan(p.log_path, secret_scan.secrets()) == []
