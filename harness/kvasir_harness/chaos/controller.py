"""The controller's faults: handed an invalid policy set, then its API
server gone for a minute (a real kube-apiserver on a real etcd, stopped
and started again on the same port). The data path does not depend on
either (Envoy keeps the configuration it was given, as Envoy Gateway keeps
its last xDS), so the load runs through the local stack meanwhile and must
lose nothing; the checks are the control plane's: the
EnvoyExtensionPolicy keeps the last good configuration, nothing is
deleted, the controller stays up and applies the next valid edit promptly
once the server is back."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from ..examples import eg_gateway, example_docs
from ..paths import REPO, WASM
from ..procs import Proc, Processes, free_port, request, wait_until
from .load import Load, LoadConfig, summarize
from .result import Result, r3, timed_wait
from .stack import chaos_stack

CONTROLLER = Path(os.environ.get("KVASIR_CONTROLLER_BIN", REPO / "target" / "release" / "kvasir-controller"))
UPSTREAM = REPO / "tests" / "upstream-crds"
GATEWAY = "inference-gateway"
EEP = f"kvasir-gateway-{GATEWAY}"
NS = "chaos"
KINDS = ("inferencepolicies", "inferencesettings", "inferencetenants", "inferenceproviders", "inferencepools",
         "envoyextensionpolicies", "secrets")
POLICY = "cheaper-model-for-easy-prompts"


def _docs() -> list[dict]:
    return example_docs(NS) + [eg_gateway(GATEWAY, NS)]


def _objects(api) -> dict[str, str]:
    """kind/name -> uid of everything the test or the controller made in the namespace."""
    out = {}
    for kind in KINDS:
        r = api.kubectl("get", kind, "-n", NS, "-o", "json", timeout=30)
        for o in json.loads(r.stdout)["items"]:
            out[f"{kind}/{o['metadata']['name']}"] = o["metadata"]["uid"]
    return out


def _get(api, kind: str, name: str) -> dict | None:
    r = api.kubectl("get", kind, name, "-n", NS, "-o", "json", check=False, timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 else None


def _condition(api, name: str, t: str) -> dict | None:
    o = _get(api, "inferencepolicy", name) or {}
    return {c["type"]: c for c in (o.get("status") or {}).get("conditions", [])}.get(t)


def controller_faults(logdir: Path, quick: bool) -> Result:
    from ..kube import ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, missing, start_apiserver, start_etcd
    r = Result("controller_faults", "controller handed an invalid policy; its API server gone for a minute",
               "make chaos SCENARIOS=controller_faults")
    gone = 10.0 if quick else 60.0
    if m := missing(ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, CONTROLLER):
        raise FileNotFoundError(f"missing {m}: run `make setup` and `make build`")
    d = logdir / "controller"
    d.mkdir(parents=True, exist_ok=True)
    with Processes() as ps, chaos_stack(logdir, "controller-data-path", sims=2, replicas=1) as st:
        etcd = ps.add(start_etcd(d))
        api = ps.add(start_apiserver(d, etcd))
        files = sorted(UPSTREAM.glob("*.yaml")) + sorted((REPO / "crds").glob("*.yaml"))
        args = ["apply", "--server-side", "--field-manager", "chaos", *[x for f in files for x in ("-f", str(f))]]
        api.kubectl(*args, timeout=90)
        names = []
        for f in files:
            names += [doc["metadata"]["name"] for doc in yaml.safe_load_all(f.read_text())
                      if doc and doc.get("kind") == "CustomResourceDefinition"]
        api.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", *[f"crd/{n}" for n in names],
                    timeout=75)
        api.kubectl("create", "namespace", "kvasir-system")
        api.kubectl("create", "namespace", NS)
        api.kubectl("apply", "--server-side", "--field-manager", "chaos", "-f", "-",
                    input=yaml.safe_dump_all(_docs()), timeout=60)
        http, metrics = free_port(), free_port()
        argv = [str(CONTROLLER), "--http-addr", f"127.0.0.1:{http}", "--metrics-addr", f"127.0.0.1:{metrics}",
                "--wasm-file", str(WASM), "--wasm-url", "http://kvasir-controller.kvasir-system.svc:8080/f.wasm",
                "--namespace", NS, "--lease-namespace", "kvasir-system", "--lease-name", "kvasir-chaos",
                "--identity", "a", "--indexer-deployment", ""]
        ctl = ps.add(Proc("controller", argv, d, env={"KUBECONFIG": str(api.kubeconfig), "RUST_LOG": "info,kube=warn"}))
        wait_until("controller /readyz", lambda: ctl.alive() and request("GET", http, "/readyz", timeout=2)[0] == 200,
                   timeout=30)
        good = wait_until("the EnvoyExtensionPolicy", lambda: _get(api, "eep", EEP), timeout=30, interval=0.2)
        wait_until("the policy programmed", lambda: (_condition(api, POLICY, "Programmed") or {}).get("status") == "True",
                   timeout=30, interval=0.2)
        before = _objects(api)
        original = _get(api, "inferencepolicy", POLICY)["spec"]["action"]["route"]["rewriteModel"]
        load = Load(LoadConfig(st.envoy.port, workers=6)).start()
        try:
            time.sleep(1.0)
            mem0 = st.memory()
            # An invalid policy set: one policy rewrites to a model no pool serves.
            api.kubectl("patch", "inferencepolicy", POLICY, "-n", NS, "--type=json", "-p", json.dumps(
                [{"op": "replace", "path": "/spec/action/route/rewriteModel", "value": "no-such-model"}]))
            refused = timed_wait("the invalid policy reported", lambda: (
                (_condition(api, POLICY, "Accepted") or {}).get("reason") == "Invalid"), timeout=15, interval=0.2)
            r.figures["invalid_reported_s"] = refused
            r.check("the invalid policy is reported Invalid within 15 s", refused is not None, refused, 15)
            after_invalid = _get(api, "eep", EEP)
            r.check("the EnvoyExtensionPolicy keeps the last good configuration",
                    after_invalid is not None and after_invalid["spec"] == good["spec"], None, "spec unchanged")
            # The API server gone.
            api_argv = api.proc.argv
            api.proc.stop()
            t_gone = time.monotonic()
            alive_throughout = True
            while time.monotonic() - t_gone < gone:
                alive_throughout &= ctl.alive()
                time.sleep(0.5)
            api.proc = Proc("kube-apiserver-again", api_argv, d)
            t_back = time.monotonic()
            wait_until("kube-apiserver /readyz again", lambda: api.get("/readyz", timeout=2)[0] == 200, timeout=90,
                       interval=0.25)
            r.figures["api_server_down_s"] = r3(t_back - t_gone)
            r.figures["api_server_ready_after_restart_s"] = r3(time.monotonic() - t_back)
            r.check("the controller stays up while the API server is gone", alive_throughout and ctl.alive(),
                    alive_throughout, True)
            time.sleep(2.0)
            after = _objects(api)
            r.check("nothing deleted (same objects, same uids)", after == before,
                    sorted(set(before) ^ set(after)) or "same", "same")
            eep = _get(api, "eep", EEP)
            r.check("the EnvoyExtensionPolicy still holds the last good configuration",
                    eep is not None and eep["spec"] == good["spec"], None, "spec unchanged")
            # A valid edit after the outage (the policy set right again) is
            # applied promptly.
            t_fix = time.monotonic()
            api.kubectl("patch", "inferencepolicy", POLICY, "-n", NS, "--type=json", "-p", json.dumps(
                [{"op": "replace", "path": "/spec/action/route/rewriteModel", "value": original}]))
            fixed = timed_wait("the fixed policy programmed", lambda: (
                (_condition(api, POLICY, "Programmed") or {}).get("status") == "True"
                and (_condition(api, POLICY, "Accepted") or {}).get("status") == "True"), timeout=60, interval=0.2)
            r.figures["valid_edit_programmed_after_outage_s"] = None if fixed is None else r3(time.monotonic() - t_fix)
            r.figures["time_to_recover_s"] = r.figures["valid_edit_programmed_after_outage_s"]
            r.check("a valid edit after the outage is programmed within 60 s", fixed is not None,
                    r.figures["valid_edit_programmed_after_outage_s"], 60)
            time.sleep(0.5)
        finally:
            load.stop()
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        r.load = summarize(load.records)
        r.check("zero failed requests through the data path meanwhile", r.load["failed"] == 0, r.load["failed"], 0)
    return r
