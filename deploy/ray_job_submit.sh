#!/usr/bin/env bash
# Run raypaged on an existing Ray cluster as a Ray job. The job joins the cluster (Ray sets
# RAY_ADDRESS for it), deploys the application and stays up; `ray job stop <id>` sends SIGTERM
# and raypaged removes the application it deployed.
#
#   RAY_ADDRESS=http://HEAD_NODE:8265 deploy/ray_job_submit.sh
#   RAY_ADDRESS=... WORKERS=4 GPUS_PER_WORKER=1 CPUS_PER_WORKER=8 deploy/ray_job_submit.sh
#
# Resources per worker are given, not read from the cluster (it may still be adding nodes).
#
# The nodes need raypaged's dependencies (an image built from deploy/Dockerfile has them and
# raypaged itself); --working-dir ships this checkout, so the job runs the code you have here.
set -euo pipefail
: "${RAY_ADDRESS:=http://127.0.0.1:8265}"
export RAY_ADDRESS

ray job submit \
  --submission-id "raypaged-serve-$(date +%s)" \
  --working-dir . \
  --runtime-env-json "{\"env_vars\": {\"RAYPAGED_API_KEY\": \"${RAYPAGED_API_KEY:-}\"}}" \
  --no-wait \
  -- python -c "import sys; from raypaged.cli import main; sys.exit(main())" \
     serve --workers "${WORKERS:-2}" --cpus-per-worker "${CPUS_PER_WORKER:-1}" \
     --gpus-per-worker "${GPUS_PER_WORKER:-0}" --host 0.0.0.0 --port 8000
