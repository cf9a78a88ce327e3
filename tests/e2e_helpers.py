"""Helpers for end-to-end tests of the operator on the real control plane: the operator as a local
process, the example SDD, and kubectl reads and waits."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from devtools.cluster.controlplane import NODES_FILE  # noqa: F401  (the fake nodes, for tests that add more)
from devtools.cluster.wait import wait_for

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml"
EXAMPLE = ROOT / "examples" / "spec-deploy.yaml"
TARGET = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
OTHER_DRAFT = "mirror/EAGLE3-LLaMA3.1-Instruct-8B-v2"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator:
    """`specdecode-operator` as a subprocess with the cluster's kubeconfig."""

    def __init__(self, cluster, namespace: str, *extra: str, env: dict | None = None):
        self.cluster, self.namespace, self.extra = cluster, namespace, extra
        self.env = env or cluster.env
        self.log = Path(cluster.logs_dir) / f"operator-{namespace}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> "Operator":
        port = free_port()
        self.starts += 1
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [str(BIN / "specdecode-operator"), "--namespace", self.namespace, "--log-format", "plain",
             "--worker-image", "specdecode/worker:test", "--liveness", f"http://127.0.0.1:{port}/healthz",
             *self.extra], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        url = self.health = f"http://127.0.0.1:{port}/healthz"

        def healthy():
            assert self.proc.poll() is None, f"operator exited {self.proc.returncode}: {self.tail()}"
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200

        wait_for(healthy, timeout=60, interval=0.5, what="operator liveness endpoint")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


def get_object(cluster, namespace, kind, name):
    r = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if r.returncode != 0:
        assert "NotFound" in r.stderr, r.stderr
        return None
    return json.loads(r.stdout)


def list_objects(cluster, namespace, kind, selector):
    return json.loads(cluster.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]


def example(**spec_changes) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    for path, value in spec_changes.items():
        node = body["spec"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return body


def apply(cluster, namespace, body, check=True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=check)


def condition(sdd, ctype):
    return next((c for c in (sdd or {}).get("status", {}).get("conditions", []) if c["type"] == ctype), None)


def wait_sdd(cluster, namespace, name, predicate, what, timeout=90):
    def check():
        sdd = get_object(cluster, namespace, "sdd", name)
        return sdd if sdd and predicate(sdd) else None

    return wait_for(check, timeout=timeout, interval=0.5, what=f"{name}: {what}")


def phase_is(phase):
    return lambda s: s.get("status", {}).get("phase") == phase


def planner_pods(cluster, namespace, name):
    return list_objects(cluster, namespace, "pods", f"specdecode.io/name={name},specdecode.io/role=planner")


def local_plan(store: Path, *args: str) -> dict:
    """The planner CLI's own output for the same models, run here."""
    out = subprocess.run([str(BIN / "specdecode-worker"), "plan", "--target", str(store / TARGET), *args,
                          "--output", "json"], capture_output=True, text=True)
    assert out.returncode in (0, 3), out.stderr
    return json.loads(out.stdout)


def greedy_reply(model_dir: Path, messages: list[dict], max_tokens: int) -> str:
    """transformers' greedy continuation of the chat, up to the end-of-turn token or max_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
