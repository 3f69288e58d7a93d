#!/usr/bin/env bash
# ferry launch: node 1 of 2 (p5.48xlarge, 8 process(es) per node), c10d rendezvous at 10.0.0.1:29500.
set -euo pipefail
cd /cluster/ferry  # where the config's relative paths (data, runs/) point
# https://github.com/pytorch/pytorch/issues/135712: after torchrun restarts the workers they reuse
#   the rendezvous store and read the previous attempt's addresses; a fresh store per attempt lets
#   them meet again
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# https://github.com/aws/aws-ofi-nccl/blob/2daf7d303aa139a03140aa530957d10521e4478d/doc/efa-env-var.md
#   says "Set to 0 when you see os.fork() causes OSError: Cannot allocate memory. Typically caused
#   by multi-process PyTorch data loaders"; AWS's FSDP sbatch template (awsome-distributed-training
#   3.test_cases/pytorch/FSDP/slurm/training-sub.template) sets it for every run. The plugin's
#   FI_EFA_FORK_SAFE=1 no longer turns huge pages off on kernels with copy-on-fork (libfabric
#   prov/efa/src/efa_fork_support.c returns early when fork support is unneeded), so a fork after
#   EFA init can still fail without this; cost: "minor performance hit".
export FI_EFA_USE_HUGE_PAGE=0
# https://github.com/aws-samples/awsome-distributed-training/blob/7217859f67bc693c52ff175ccc6082c41dbd7a1b/micro-benchmarks/nccl-tests/nccl-tests.Dockerfile
#   sets "NCCL_SOCKET_IFNAME=^docker,lo,veth" (as do AWS's Slurm nccl-tests sbatch and its DeepEP
#   and pplx expert-parallel images). This only excludes: NCCL's default already skips lo and
#   docker* (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html, "the loopback
#   interface (lo) and docker interfaces (docker*) would not be selected"), and veth* are node-local
#   container pairs that cannot carry bootstrap traffic to another node. It keeps both a pod's eth0
#   and a host's en* interface, so one value serves Slurm and Kubernetes.
export NCCL_SOCKET_IFNAME='^docker,lo,veth'
exec torchrun \
  --nnodes 2 \
  --nproc-per-node 8 \
  --rdzv-backend c10d \
  --rdzv-endpoint 10.0.0.1:29500 \
  --rdzv-id tiny \
  --max-restarts 3 \
  -m ferry train /cluster/ferry/launch/tiny/run.yaml
