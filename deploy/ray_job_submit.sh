#!/usr/bin/env bash
# Run raypaged on an existing Ray cluster as a Ray job (Ray sets RAY_ADDRESS for the job, so it
# joins the cluster). Two jobs:
#
#   serve (default): deploys the application and stays up; `ray job stop <id>` sends SIGTERM and
#   raypaged removes the application it deployed. It listens on 127.0.0.1 of each node unless
#   HOST says otherwise (HOST=0.0.0.0 to take connections from other hosts: then set a key).
#     RAY_ADDRESS=http://HEAD_NODE:8265 deploy/ray_job_submit.sh
#     RAY_ADDRESS=... WORKERS=4 GPUS_PER_WORKER=1 CPUS_PER_WORKER=8 deploy/ray_job_submit.sh
#   The API key is never sent with the job: a job's runtime_env (and its entrypoint) is shown to
#   anyone who can read the Jobs API. Give it to the cluster instead: RAYPAGED_API_KEY in the
#   environment of every `ray start` (the Helm chart sets it from a Secret); the job's driver and
#   the router replicas inherit it from their node. An empty RAYPAGED_API_KEY stops the router.
#
#   On a cluster with Ray's token authentication (the Helm chart's, or RAY_AUTH_MODE=token), this
#   shell needs the token too: RAY_AUTH_TOKEN, or ~/.ray/auth_token.
#
#   batch IN OUT: answers an OpenAI Batch JSONL file with a pool of engine actors and ends; run
#   it again with the same arguments after a `ray job stop` or a lost node and it resumes.
#     RAY_ADDRESS=... deploy/ray_job_submit.sh batch /data/in.jsonl /data/out.jsonl
#   IN and OUT are paths on the node that runs the job driver (a shared volume on Kubernetes);
#   a relative IN is read from the shipped working directory.
#
# Resources per worker are given, not read from the cluster (it may still be adding nodes).
#
# The nodes need raypaged's dependencies (an image built from deploy/Dockerfile has them and
# raypaged itself); --working-dir ships this checkout, so the job runs the code you have here.
set -euo pipefail
: "${RAY_ADDRESS:=http://127.0.0.1:8265}"
export RAY_ADDRESS
MODE="${1:-serve}"
RESOURCES=(--workers "${WORKERS:-2}" --cpus-per-worker "${CPUS_PER_WORKER:-1}"
           --gpus-per-worker "${GPUS_PER_WORKER:-0}")

case "$MODE" in
  serve)
    ray job submit \
      --submission-id "raypaged-serve-$(date +%s)" \
      --working-dir . \
      --no-wait \
      -- python -c "import sys; from raypaged.cli import main; sys.exit(main())" \
         serve "${RESOURCES[@]}" --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}"
    ;;
  batch)
    if [ "$#" -ne 3 ]; then
      echo "usage: $0 batch INPUT.jsonl OUTPUT.jsonl" >&2
      exit 2
    fi
    # Waits for the job and prints its log (progress lines, then the summary).
    ray job submit \
      --submission-id "raypaged-batch-$(date +%s)" \
      --working-dir . \
      -- raypaged batch "$2" "$3" "${RESOURCES[@]}"
    ;;
  *)
    echo "usage: $0 [serve | batch INPUT.jsonl OUTPUT.jsonl]" >&2
    exit 2
    ;;
esac
