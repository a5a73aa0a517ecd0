"""`sits generate "prompt"`: one answer in the shell, streamed to stdout as it is generated."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from sits.runtime.commands.engine_args import (
    ConfigError,
    add_engine_arguments,
    configure_logging,
    engine_config_from_args,
    fail,
)
from sits.runtime.commands.serve import add_chat_template_argument, with_chat_template

PROG = "sits generate"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="answer one prompt in the shell",
                                   description="Generate an answer to one prompt and stream it to stdout.")
    parser.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--request-seed", type=int, default=None, help="seed for sampling (reproducible output)")
    parser.add_argument("--system", default=None, help="a system message (chat mode)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the model's chat template (default) or send it raw")
    parser.add_argument("--lora", default=None, metavar="NAME",
                        help="answer with this LoRA adapter (a name given to --lora-modules)")
    add_engine_arguments(parser)
    add_chat_template_argument(parser)
    parser.set_defaults(handler=run, log_level="warning")
    return parser


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool, system: str | None) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt, add_special_tokens=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


async def stream_answer(engine: Any, args: argparse.Namespace, prompt: str) -> int:
    from sits.runtime.engine.request import SamplingParams, SamplingParamsError
    from sits.runtime.models.chat_template import ChatTemplateError
    from sits.runtime.server.request_ids import new_request_id

    await engine.start()
    try:
        try:
            ids = prompt_token_ids(engine.tokenizer, prompt, args.chat, args.system)
        except ChatTemplateError as error:
            return fail(PROG, f"cannot build the chat prompt: {error} (try --no-chat)")
        room = engine.max_model_len - len(ids)
        if room < 1:
            return fail(PROG, f"the prompt has {len(ids)} tokens; the model's context is {engine.max_model_len}")
        params = SamplingParams(max_tokens=min(args.max_tokens, room), temperature=args.temperature,
                                top_p=args.top_p, seed=args.request_seed)
        try:
            params.validate()
        except SamplingParamsError as error:
            return fail(PROG, f"--{error.param.replace('_', '-')}: {error}")
        async for output in engine.generate(ids, params, new_request_id("gen"), lora=args.lora):
            sys.stdout.write(output.outputs[0].text_delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    finally:
        await engine.shutdown(0.0)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        config = with_chat_template(engine_config_from_args(args), args)
        served = [module.name for module in config.lora.modules]
        if args.lora is not None and args.lora not in served:
            raise ConfigError(f"--lora {args.lora}: no such adapter in --lora-modules ({', '.join(served) or 'none'})")
    except ConfigError as error:
        return fail(PROG, str(error))
    from sits.runtime.commands.loading import load_engine

    # a bar on a terminal while the model loads; in a pipe the progress lines are INFO, below the default level
    engine = load_engine(config, PROG, progress=True)
    if isinstance(engine, int):
        return engine
    try:
        return asyncio.run(stream_answer(engine, args, prompt))
    except KeyboardInterrupt:
        return 130
