"""`raypaged generate | plan | serve | batch`."""
from __future__ import annotations

import argparse
import sys

from raypaged.config import EngineArgs
from raypaged.settings import add_cli_args, from_namespace


def _generate(ns: argparse.Namespace) -> None:
    from raypaged.chat import chat_token_ids
    from raypaged.core.sampling_params import SamplingParams
    from raypaged.engine import Engine

    engine = Engine.from_args(from_namespace(EngineArgs, ns))
    tok = engine.tokenizer
    # default: instruct models answer questions best through their chat template
    chat = bool(getattr(tok, "chat_template", None)) if ns.chat is None else ns.chat
    ids = (chat_token_ids(tok, [{"role": "user", "content": ns.prompt}]) if chat
           else tok.encode(ns.prompt))
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.seed,
                            top_p=ns.top_p)
    engine.add_request("cli", ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def _plan(ns: argparse.Namespace) -> None:
    from raypaged.model.setup import plan_for

    print(plan_for(from_namespace(EngineArgs, ns)).report())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raypaged", description="LLM serving on Ray with paged attention")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    g.add_argument("prompt")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    add_cli_args(g, EngineArgs)
    g.set_defaults(func=_generate)

    pl = sub.add_parser("plan", help='print the "what fits" report for a model and KV budget')
    add_cli_args(pl, EngineArgs)
    pl.set_defaults(func=_plan)

    try:
        from raypaged.serve.cli import add_serve_parser
    except ImportError as e:  # ray missing: generate and plan still work
        why = f"raypaged serve needs ray[serve]: {e}"  # `e` is unbound after the except block
        sv = sub.add_parser("serve", help=f"unavailable: {e}")
        sv.set_defaults(func=lambda ns: sys.exit(why))
    else:
        add_serve_parser(sub)
    from raypaged.batch.cli import add_batch_parser  # ray is imported only when a batch runs
    add_batch_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
