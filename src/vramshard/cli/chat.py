"""``vramshard chat MODEL``: an interactive conversation through the model's chat template.

Answers stream as they are generated. Ctrl-C during an answer stops that answer and returns to
the prompt; Ctrl-D or ``/exit`` quits; ``/clear`` forgets the conversation. When the history no
longer fits the context, the oldest turns are dropped (the system message stays).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from ..errors import InvalidInputError
from .common import add_engine_args, add_sampling_args, load_engine, print_stats, stderr_console, stream

EXIT_COMMANDS = ("/exit", "/quit", "/bye")
HELP = "/exit or Ctrl-D quits · /clear forgets the conversation · Ctrl-C stops an answer"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "chat", help="chat interactively with a model (chat template, history, streaming)",
        description=f"Interactive chat. {HELP}.",
    )
    parser.add_argument("model", metavar="MODEL", help="Hugging Face model directory or .gguf file")
    parser.add_argument("--system", metavar="TEXT", default=None, help="system message that starts the chat")
    add_sampling_args(parser, max_new_tokens=512)
    add_engine_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    console = stderr_console()
    engine = load_engine(args.model, args, console)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidInputError(f"{args.model} has no tokenizer files (tokenizer.json), so it cannot chat; "
                                "use `vramshard run MODEL --ids ...` instead")
    system = [{"role": "system", "content": args.system}] if args.system else []
    tokenizer.apply_chat_template(system + [{"role": "user", "content": "hi"}])  # fail now if no template
    history = list(system)
    # One scheduler for the whole conversation: its prefix cache keeps the KV of the turns read so
    # far, so each answer starts after reading only the new message (and the last answer's tail).
    conversation = engine.scheduler(max_seqs=1)
    console.print(f"[bold]{engine.model_name}[/bold] [dim]({HELP})[/dim]")
    while True:
        try:
            line = console.input("[bold green]>>> [/]").strip()
        except EOFError:
            console.print()
            return 0
        except KeyboardInterrupt:
            console.print("\n[dim](/exit or Ctrl-D to quit)[/dim]")
            continue
        if not line:
            continue
        if line in EXIT_COMMANDS:
            return 0
        if line == "/clear":
            history = list(system)
            console.print("[dim](conversation cleared)[/dim]")
            continue
        history.append({"role": "user", "content": line})
        prompt_ids = fit_to_context(tokenizer, history, engine.max_context, len(system), console)
        if prompt_ids is None:
            history.pop()
            continue
        budget = min(args.max_new_tokens, engine.max_context - len(prompt_ids))
        result = stream(engine, prompt_ids, args, max_new_tokens=budget, interruptible=True, scheduler=conversation)
        console.print()
        history.append({"role": "assistant", "content": result.text})
        print_stats(console, result)


def fit_to_context(tokenizer, history: list[dict], max_context: int, keep: int, console: Console,
                   min_answer: int = 16) -> list[int] | None:
    """Token ids of the rendered chat, dropping the oldest turns after the first ``keep`` messages
    until it leaves ``min_answer`` tokens for the answer; None (with a message) if the last
    message alone is too long."""
    while True:
        ids = tokenizer.encode_chat(history)
        if len(ids) + min_answer <= max_context:
            return ids
        turns = history[keep:]
        if len(turns) <= 1:
            console.print(f"[red]that message is {len(ids)} tokens; the context holds {max_context}. "
                          "Send something shorter.[/red]")
            return None
        # Drop the oldest user turn and the answers that followed it.
        nxt = next((i for i in range(1, len(turns)) if turns[i]["role"] == "user"), len(turns) - 1)
        del history[keep:keep + nxt]
        console.print("[dim](oldest turn dropped to fit the context)[/dim]")
