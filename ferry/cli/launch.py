"""`ferry launch CONFIG --platform NAME --nodes N`: the files that start the job on a cluster."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_launch_command(commands) -> None:
    launch = commands.add_parser(
        "launch", help="write the torchrun, Slurm and Kubernetes files that run CONFIG on a cluster"
    )
    launch.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides baked into run.yaml")
    launch.add_argument("--platform", required=True, help="a node type in ferry/launch/platforms, e.g. p5.48xlarge")
    launch.add_argument("--nodes", type=int, required=True, metavar="N", help="number of nodes")
    launch.add_argument(
        "--nproc-per-node", type=int, default=None, metavar="N", help="ranks per node (default: every accelerator)"
    )
    launch.add_argument(
        "--scheduler", choices=["torchrun", "slurm", "k8s"], default=None, help="render one form (default: all three)"
    )
    launch.add_argument("--out", default=None, help="directory to write (default: launch/<job name>)")
    launch.add_argument("--explain", action="store_true", help="print every environment variable and its origin")
    launch.add_argument("--job-name", default=None, help="default: run.name")
    launch.add_argument(
        "--rendezvous",
        choices=["c10d", "static"],
        default=None,
        help="torchrun form: c10d (the same command on every node; the default) or static (master address and node "
        "rank)",
    )
    launch.add_argument("--master-addr", default=None, help="torchrun form: address of the first node")
    launch.add_argument("--port", type=int, default=29500, help="rendezvous port (default 29500)")
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="torchrun restarts a node's workers up to K times, resuming from the newest checkpoint (default 3)",
    )
    launch.add_argument(
        "--image", default=None, help="Kubernetes: container image with ferry installed (default ferry:latest)"
    )
    launch.add_argument(
        "--runs-claim",
        default=None,
        help="Kubernetes: ReadWriteMany PersistentVolumeClaim mounted as the runs directory (default ferry-runs)",
    )
    launch.add_argument("--partition", default=None, help="Slurm partition")
    launch.add_argument("--time", default=None, help="Slurm time limit, e.g. 48:00:00")
    launch.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the files of an earlier render, and remove those this render does not write",
    )
    launch.set_defaults(handler=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    from ferry.launch import build_launch_spec, write_launch
    from ferry.launch.environment import explain

    spec = build_launch_spec(
        args.config,
        list(args.overrides),
        platform=args.platform,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        scheduler=args.scheduler,
        job_name=args.job_name,
        rendezvous=args.rendezvous,
        master_addr=args.master_addr,
        port=args.port,
        max_restarts=args.max_restarts,
        image=args.image,
        runs_claim=args.runs_claim,
        slurm_partition=args.partition,
        slurm_time=args.time,
    )
    out = Path(args.out) if args.out else Path("launch") / spec.job_name
    if args.explain:
        print(explain(spec))
        print()
    files = write_launch(spec, out, overwrite=args.overwrite)
    print(
        f"ferry: {spec.job_name}: {spec.nodes} node(s) of {spec.platform.name} x {spec.nproc_per_node} = "
        f"{spec.world_size} ranks; wrote {len(files)} file(s) to {out}/"
    )
    for name in files:
        print(f"  {out / name}")
    return 0
