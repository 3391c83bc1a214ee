"""`ironlm generate` and `ironlm chat`: the engine in-process, tokens streamed to the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from ironlm.cli_args import add_engine_args, config_from_args, model_from_args


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible output)")


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="complete one prompt, streaming to the terminal",
                       usage="ironlm generate [MODEL] PROMPT [options]")
    p.add_argument("positionals", nargs="+", metavar="[MODEL] PROMPT")
    add_engine_args(p, positional_model=False)
    _add_sampling_args(p)
    p.add_argument("--chat-template", action="store_true", help="wrap PROMPT as a user message first")
    p.set_defaults(func=cmd_generate)


def add_chat_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat with the model's chat template (/reset, /exit)")
    add_engine_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)


def _engine(args: argparse.Namespace, model: str | None) -> Any:
    import logging

    from ironlm.engine import LLMEngine

    logging.basicConfig(level=logging.WARNING)
    return LLMEngine(config_from_args(args, model))


def _params(args: argparse.Namespace) -> Any:
    from ironlm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def stream_to(engine: Any, request_id: str, prompt: str | list[int], params: Any, out: TextIO) -> str:
    """Run one request to completion, writing its text as it grows; returns the full text."""
    engine.add_request(request_id, prompt, params)
    text = ""
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                if o.error:
                    raise RuntimeError(o.error)
                new = o.outputs[0].text
                out.write(new[len(text):])
                out.flush()
                text = new
    except KeyboardInterrupt:  # Ctrl-C stops this reply, not the program
        engine.abort_request(request_id)
        out.write(" [interrupted]")
    out.write("\n")
    out.flush()
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    pos = args.positionals
    if len(pos) > 2:
        print("ironlm generate: expected [MODEL] PROMPT (quote the prompt)", file=sys.stderr)
        return 2
    model, prompt = (pos[0], pos[1]) if len(pos) == 2 else (model_from_args(args), pos[0])
    params = _params(args)
    engine = _engine(args, model)
    if args.chat_template:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    stream_to(engine, "generate-0", prompt, params, sys.stdout)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    engine = _engine(args, model_from_args(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"ironlm chat with {engine.model_name}. /reset clears the history, /exit or Ctrl-D quits.")
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = engine.apply_chat_template(system + history)
            reply = stream_to(engine, f"chat-{turn}", prompt, params, sys.stdout)
        except ValueError as exc:  # e.g. the history outgrew max_model_len: keep the session alive
            history.pop()
            print(f"error: {exc} (/reset clears the history)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
        turn += 1
    return 0
