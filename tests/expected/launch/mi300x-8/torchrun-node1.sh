#!/usr/bin/env bash
# ferry launch: node 1 of 2 (mi300x-8, 8 process(es) per node), static rendezvous, master 10.0.0.1:29500.
set -euo pipefail
cd /cluster/ferry  # where the config's relative paths (data, runs/) point
# https://github.com/pytorch/pytorch/issues/135712: after torchrun restarts the workers they reuse
#   the rendezvous store and read the previous attempt's addresses; a fresh store per attempt lets
#   them meet again
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# https://rocm.docs.amd.com/projects/gpu-cluster-networking/en/latest/how-to/multi-node-config.html
#   (its rccl-tests script: "set these environment variables if using RoCE interconnect", then
#   "export NCCL_IB_GID_INDEX=3"; its RCCL command passes "-x NCCL_IB_GID_INDEX=3"); AMD's training
#   validation guide (ROCm/ROCm
#   docs/how-to/rocm-for-ai/training/prerequisite-system-validation.rst): "define the Global ID
#   index used in RoCE mode", "export NCCL_IB_GID_INDEX=3". AMD's value for RoCE clusters; a cluster
#   whose NICs list their RoCE v2 GID at another index (show_gids) must change it.
export NCCL_IB_GID_INDEX=3
# https://github.com/ROCm/ROCm/blob/e396b4898f459db094bfd60b876f419f77eb9f09/docs/how-to/rocm-for-ai/inference-optimization/workload.rst
#   (MI300X workload optimization, "Multi-node FSDP and RCCL settings"): the HIP streams of RCCL and
#   of compute "do not always overlap well. As a workaround, it's recommended to use high-priority
#   HIP streams with RCCL": "Set environment variable TORCH_NCCL_HIGH_PRIORITY=1 to force all RCCL
#   streams to be high-priority" (read by torch's ProcessGroupNCCL). ferry's FSDP2 baseline is such
#   a case: FSDP2 issues its all-gathers and reduce-scatters on streams of their own.
export TORCH_NCCL_HIGH_PRIORITY=1
# https://github.com/ROCm/ROCm/blob/e396b4898f459db094bfd60b876f419f77eb9f09/docs/how-to/rocm-for-ai/inference-optimization/workload.rst
#   (same "Multi-node FSDP and RCCL settings" section): "Set environment variable
#   GPU_MAX_HW_QUEUES=2 via the HIP runtime library", and "Hardware efficiency is maximized with 4
#   or fewer HIP streams"; with TORCH_NCCL_HIGH_PRIORITY this gives two compute and two RCCL
#   streams.
export GPU_MAX_HW_QUEUES=2
# https://github.com/ROCm/ROCm/blob/e396b4898f459db094bfd60b876f419f77eb9f09/docs/how-to/rocm-for-ai/training/prerequisite-system-validation.rst
#   sets "export RCCL_MSCCL_ENABLE=0" to "avoid data corruption/mismatch issue that existed in past
#   releases" (also the default of AMD's Primus, runner/helpers/envs/base_env.sh). A no-op on RCCL
#   builds where "MSCCL and MSCCL++ integration has been removed" (RCCL usage tips, 7.13 preview).
export RCCL_MSCCL_ENABLE=0
# https://github.com/AMD-AGI/Primus/blob/fd1eeabbad15135e3702094087e96142b4b4eacb/runner/helpers/envs/base_env.sh
#   (AMD's training framework): "Must disable scratch reclaim to avoid MoE training crash on AMD
#   GPUs", exported as HSA_NO_SCRATCH_RECLAIM=1. ROCr documents 1 as: the runtime "will allocate and
#   permanently assign device memory to the queue handling the dispatch" (default 0, reclaim above a
#   threshold;
#   https://rocm.docs.amd.com/projects/ROCR-Runtime/en/latest/api-reference/environment_variables.html).
export HSA_NO_SCRATCH_RECLAIM=1
exec torchrun \
  --nnodes 2 \
  --nproc-per-node 8 \
  --node-rank 1 \
  --master-addr 10.0.0.1 \
  --master-port 29500 \
  --max-restarts 0 \
  -m ferry train /cluster/ferry/launch/tiny/run.yaml
