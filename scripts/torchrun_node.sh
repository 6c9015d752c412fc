#!/bin/bash
# One node of a multi-node run without SLURM: run this on every node with its NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/torchrun_node.sh configs/gsm8k_qwen2.5-0.5b.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/torchrun_node.sh configs/gsm8k_qwen2.5-0.5b.yaml
# torchrun starts one process per GPU; Lightning reads torchrun's variables (TorchElasticEnvironment).
set -euo pipefail
CONFIG=${1:?usage: NNODES=N NODE_RANK=R MASTER_ADDR=host scripts/torchrun_node.sh CONFIG [grpo fit args...]}
shift
NPROC=${NPROC_PER_NODE:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec python3 -m torch.distributed.run --nnodes "${NNODES:?}" --node_rank "${NODE_RANK:?}" \
  --nproc_per_node "$NPROC" --master_addr "${MASTER_ADDR:?}" --master_port "${MASTER_PORT:-29500}" \
  -m grpo_lightning.cli fit --config "$CONFIG" --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC" "$@"
