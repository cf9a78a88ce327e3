"""The test bed: a real Kubernetes control plane on loopback, built from Go modules.

build.sh + versions.env     pinned binaries, cached under ~/.cache/specdecode/cluster/<key>/bin
controlplane.py             etcd, kube-apiserver, controller-manager, scheduler, KWOK as processes
kwok-stages.yaml            what a kubelet would do, as KWOK stages
nodes.yaml                  fake GPU nodes: h100-node-1, h100-node-2 (8 x H100), l4-node-1 (1 x L4)
planner_runtime.py          runs planner pods' containers as local processes
local_volumes.py            binds claims to folders under the plane's pvc root
wait.py                     wait_for(), the one way tests wait
__main__.py                 python -m devtools.cluster up|down|status|env (make cluster-up/down)
"""
