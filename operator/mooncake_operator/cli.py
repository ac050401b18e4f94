"""``mooncake-operator operator``: run the kopf operator, print or check the CRD.

``operator run`` starts the operator against the current kubeconfig (or the pod's service
account); with ``--gateway`` it also starts the gateway as a process beside it (local
mode: the chart runs it as a sidecar container instead), serving every MooncakeCluster the
operator watches.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

GATEWAY_STOP_TIMEOUT_S = 10.0
#: prctl option: the signal a child gets when its parent dies
PR_SET_PDEATHSIG = 1
CRD_READY_TIMEOUT_S = 60.0
CRD_POLL_S = 0.2


def _die_with_parent() -> None:
    """In the gateway child (Linux): be sent SIGTERM when the operator process dies, so a
    killed operator leaves no gateway behind."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def _gateway_beside(args: argparse.Namespace) -> Iterator[None]:
    if not args.gateway:
        yield
        return
    argv = [sys.executable, "-m", "mooncake_cli", "gateway", "--kubernetes-models",
            "--host", args.gateway_host, "--port", str(args.gateway_port)]
    for ns in args.namespace or []:
        argv += ["--namespace", ns]
    proc = subprocess.Popen(argv, preexec_fn=_die_with_parent)
    os.environ.setdefault("MOONCAKE_OPERATOR_GATEWAY_URL",
                          f"http://{args.gateway_host}:{args.gateway_port}")
    try:
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(GATEWAY_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()


def install_crd(timeout_s: float = CRD_READY_TIMEOUT_S) -> None:
    """Server-side apply of the CRD (large CRDs overflow client-side apply's annotation),
    then wait until the API server serves it: kopf scans the API once at startup and would
    otherwise miss a group that is not in discovery yet, and serve nothing."""
    import json
    import time

    from mooncake_kube.client import KubeClient, KubeError, api_client_from_env

    from . import crd

    kube = KubeClient(api_client_from_env())
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}"
    kube.call("PATCH", path, json.dumps(crd.crd()), "application/apply-patch+yaml",
               {"fieldManager": "mooncake-operator", "force": "true"})
    deadline = time.monotonic() + timeout_s
    while True:
        conds = (kube.call("GET", path).get("status") or {}).get("conditions") or []
        established = any(c.get("type") == "Established" and c.get("status") == "True"
                          for c in conds)
        if established:
            try:
                served = kube.call("GET", f"/apis/{crd.GROUP}/{crd.VERSION}")
            except KubeError:
                served = None
            if served and any(r.get("name") == crd.PLURAL
                              for r in served.get("resources") or []):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"CRD {crd.CRD_NAME} not served after {timeout_s:.0f} s")
        time.sleep(CRD_POLL_S)


def run(args: argparse.Namespace) -> int:
    import kopf

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.install_crd:
        install_crd()
    from . import handlers  # noqa: F401  (registers the handlers)

    namespaces = args.namespace or []
    with _gateway_beside(args):
        kopf.run(standalone=True, namespaces=namespaces, clusterwide=not namespaces,
                 liveness_endpoint=args.liveness)
    return 0


def crd_command(args: argparse.Namespace) -> int:
    from . import crd

    argv = (["--write"] if args.write else []) + (["--check"] if args.check else [])
    if args.reference:
        return reference_command(argv)
    return crd.main(argv)


def reference_command(argv: list[str]) -> int:
    """``crd --reference``: docs/reference.md, rendered from the CRD, instead of it."""
    from . import crdref

    return crdref.main(argv)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "operator", help="the Kubernetes operator (kopf) and its CRD",
        description="Reconcile MooncakeCluster objects into prefill/decode pools, a Mooncake "
        "Store and the gateway's view; place hot-prefix replicas.")
    sub = p.add_subparsers(dest="operator_command", metavar="ACTION")
    sub.required = True
    r = sub.add_parser("run", help="run the operator against the current kubeconfig")
    r.add_argument("--namespace", "-n", action="append", help="watch only this namespace "
                   "(repeatable; default: all namespaces)")
    r.add_argument("--gateway", action="store_true",
                   help="also run the gateway as a process beside the operator (local mode)")
    r.add_argument("--gateway-host", default="127.0.0.1")
    r.add_argument("--gateway-port", type=int, default=8080)
    r.add_argument("--install-crd", action="store_true",
                   help="server-side apply the CRD first (needs cluster-scoped rights)")
    r.add_argument("--liveness", default=None,
                   help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    r.add_argument("--log-level", default="INFO")
    r.set_defaults(handler=run)
    cp = sub.add_parser("crd", help="print the MooncakeCluster CRD (generated from the models)")
    cp.add_argument("--write", action="store_true",
                    help="write crds/ and the chart's charts/mooncake-operator/crds/ of this "
                    "checkout")
    cp.add_argument("--check", action="store_true",
                    help="exit 1 when crds/ or the chart's copy is out of date")
    cp.add_argument("--reference", action="store_true", help=(
        "the configuration reference rendered from the CRD (docs/reference.md) instead: "
        "print it, --write it or --check it"))
    cp.set_defaults(handler=crd_command)
