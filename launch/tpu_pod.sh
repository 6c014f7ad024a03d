#!/usr/bin/env bash
# Runs a launcher on every worker of a Cloud TPU VM pod slice at once: one JAX process per host, one mesh over
# every chip of the slice. From the repository root of your workstation:
#
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a launch/tpu_pod.sh --config=configs/grpo_arith.py:batch=256 \
#       --workdir=/mnt/shared/runs/arith_b256 --config.sft.cache_dir=/mnt/shared/base
#
# which is exactly
#
#   gcloud compute tpus tpu-vm ssh my-v5p-32 --zone=us-east5-a --worker=all --command="cd jaxrl_batch && \
#       python3 -m launch.train --distributed --config=configs/grpo_arith.py:batch=256 \
#       --workdir=/mnt/shared/runs/arith_b256 --config.sft.cache_dir=/mnt/shared/base"
#
# `--distributed` calls jax.distributed.initialize(), which finds the coordinator and each worker's rank on a TPU pod
# by itself; only process 0 logs progress and writes metrics.jsonl/config.json. Beforehand, every worker needs this
# repository and its Python environment at $REPO_DIR (e.g. `--worker=all --command="git clone ... && pip install ..."`),
# and --workdir and --config.sft.cache_dir must be on a filesystem every worker mounts (Filestore NFS, a gcsfuse
# bucket): orbax writes each checkpoint from all hosts together.
#
# Environment: TPU_NAME, ZONE (required); PROJECT (gcloud's default if unset); REPO_DIR (relative to the remote home
# directory, default jaxrl_batch); PYTHON (default python3); MODULE (default launch.train; launch.study, launch.sft);
# INSTALL=1 first runs `pip install -e '.[tpu]'` (JAX's TPU build) in REPO_DIR on every worker.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
args=$(printf ' %q' "$@")
exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} --worker=all \
    --command="cd ${REPO_DIR:-jaxrl_batch} && ${INSTALL:+${PYTHON:-python3} -m pip install -e '.[tpu]' && }${PYTHON:-python3} -m ${MODULE:-launch.train} --distributed$args"
