"""Command line: `kvchat` (the app), `kvchat ask`, `kvchat compare`, `kvchat sessions ...`,
`kvchat models`, `kvchat bench ...`, one module per command group.

Every user error ends as one line on stderr naming the cause and the way out, exit
code 2; never a traceback.
"""

from __future__ import annotations

import os
import sys
import threading

from kvchat.cli.parser import EXIT_USAGE, UserError, parse_args


def finished(code: int, own_process: bool) -> int:
    """The end of a command that loaded the model (`ask`, `compare`, the app), its output
    printed and its store closed. When the process is kvchat's own (not a caller's
    `main([...])`) and no thread Python would wait for runs, exit at once: the teardown of
    torch's, transformers' and Textual's objects does nothing the OS does not do, and takes
    0.1-0.25 s after `ask`, 0.15-0.2 s after the app's Ctrl+Q (on a 2-core EPYC)."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if not own_process or others:
        return code
    sys.stdout.flush()  # (a closed pipe raises here, and `main` stops quietly)
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    from kvchat.errors import DocumentError, ModelError, StoreError
    from kvchat.optional import INSTALL, MissingPackage

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        # Each command's module is imported when that command runs: a one-shot `ask` does
        # not pay for the app's, the bench's or the document readers' imports.
        if args.command in ("ask", "compare"):
            from kvchat.cli.ask import cmd_ask, cmd_compare

            command = cmd_ask if args.command == "ask" else cmd_compare
            return finished(command(args), own_process=argv is None)
        if args.command == "sessions":
            from kvchat.cli.sessions import cmd_sessions

            return cmd_sessions(args)
        if args.command == "models":
            from kvchat.cli.models import cmd_models

            return cmd_models(args)
        if args.command == "bench":
            from kvchat.cli.bench import cmd_bench

            return cmd_bench(args)
        from kvchat.cli.app import cmd_app

        return finished(cmd_app(args), own_process=argv is None)
    except (UserError, ModelError, StoreError, DocumentError, ValueError, MissingPackage) as err:
        print(f"kvchat: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top not in INSTALL:
            raise
        print(f"kvchat: error: {MissingPackage(top)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and friends: stop quietly.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0


if __name__ == "__main__":
    sys.exit(main())
