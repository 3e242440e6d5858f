"""`kiln fleet`: start the fleet (kiln/fleet/app.py) on a local Ray, or join a cluster with --ray-address,
and serve until SIGINT/SIGTERM, then stop it gracefully: each replica saves and hands off its sessions."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.server.app import ServeOptions, api_keys_for

ENV_KEY = "KILN_API_KEY"


def run(args: argparse.Namespace, engine_options: dict[str, object]) -> int:
    try:
        import ray
        from ray import serve

        from kiln.fleet.app import FLEET_LEASE_TTL_S, FleetOptions, start_fleet
        from kiln.fleet.replica import ReplicaSpec
    except ImportError as error:
        raise FailedPreconditionError(f"kiln fleet needs Ray Serve: pip install 'kiln[fleet]' ({error})") from None
    if not args.snapshot_store:
        raise InvalidArgumentError("kiln fleet needs --snapshot-store redis://host:port/db: the replicas share "
                                   "their sessions through it", "snapshot_store")
    serve_options = ServeOptions(
        host=args.host, http_port=args.http_port, api_keys=tuple(args.api_key), api_keys_file=args.api_keys_file,
        insecure_no_auth=args.insecure_no_auth, served_model_names=tuple(args.served_model_name),
        allowed_hosts=tuple(args.allowed_host), chat_format=args.chat_format,
        env={ENV_KEY: os.environ[ENV_KEY]} if os.environ.get(ENV_KEY) else {})  # the replicas' keys are the CLI's
    keys = api_keys_for(serve_options)  # refuse an unsafe bind before Ray starts anything
    if args.grpc_port is not None and not keys.enabled and not args.insecure_no_auth:
        raise InvalidArgumentError("Ray Serve's gRPC proxy listens on every interface, whatever --host says: "
                                   "--grpc-port needs an API key (--api-key, --api-keys-file or KILN_API_KEY), or "
                                   "--insecure-no-auth if the network is trusted", "grpc_port")
    options = FleetOptions(replicas=args.replicas, http_host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                           replica_cpus=args.replica_cpus, ray_address=args.ray_address)
    engine_options = {k: v for k, v in engine_options.items() if k not in ("snapshot_store", "snapshot_dir")}
    spec = ReplicaSpec(args.model, args.snapshot_store, FLEET_LEASE_TTL_S, serve_options, engine_options)
    start_fleet(spec, options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    grpc = f" grpc=[::]:{args.grpc_port}" if args.grpc_port is not None else ""
    print(f"kiln fleet: ready replicas={args.replicas} http=http://{args.host}:{args.http_port}{grpc} "
          f"store={args.snapshot_store} ray={ray.get_runtime_context().gcs_address}", file=sys.stderr, flush=True)
    stop.wait()
    print("kiln fleet: stopping (each replica saves and hands off its sessions)", file=sys.stderr, flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
