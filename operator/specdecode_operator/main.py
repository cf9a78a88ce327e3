"""``specdecode-operator``: run the kopf operator for SpecDecodeDeployments.

One replica only (kopf peering is not leader election): deploy it with strategy Recreate.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .spec import DEFAULT_WORKER_IMAGE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdecode-operator", description=__doc__.splitlines()[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable); default: every namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--worker-image", default=os.environ.get("SPECDECODE_WORKER_IMAGE", DEFAULT_WORKER_IMAGE),
                   help="worker image for SDDs that do not set spec.image (env SPECDECODE_WORKER_IMAGE)")
    p.add_argument("--liveness", default=os.environ.get("SPECDECODE_LIVENESS", "http://0.0.0.0:8080/healthz"),
                   help="liveness endpoint URL; /metrics on the same port serves the SDDs' conditions; "
                        "'off' disables both")
    p.add_argument("--no-node-check", action="store_true",
                   help="do not read nodes (namespaced RBAC): GPUs per node come from gpu.perNode or "
                        "default to 8, and PlanExceedsNodeGPUs is not reported")
    p.add_argument("--worker-network-policy", action="store_true",
                   default=os.environ.get("SPECDECODE_WORKER_NETWORK_POLICY", "") == "true",
                   help="the worker pods' NetworkPolicy admits only the serving port: give each SDD whose "
                        "replicas span pods a NetworkPolicy <name>-ranks for traffic between its own pods "
                        "(env SPECDECODE_WORKER_NETWORK_POLICY=true)")
    p.add_argument("--log-format", choices=["json", "plain"], default=os.environ.get("SPECDECODE_LOG_FORMAT", "json"))
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import kopf

    from . import handlers, health
    from .reconcile import Options

    kopf.configure(verbose=args.verbose,
                   log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if args.liveness != "off":
        try:
            health.endpoint(args.liveness)
        except ValueError as exc:
            print(f"specdecode-operator: {exc}", file=sys.stderr)
            return 2
    handlers.configure(Options(default_image=args.worker_image, check_nodes=not args.no_node_check,
                               rank_network_policy=args.worker_network_policy),
                       scanning=not args.namespace, health_url=None if args.liveness == "off" else args.liveness)
    kwargs = {"namespaces": args.namespace} if args.namespace else {"clusterwide": True}
    kopf.run(standalone=True, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
