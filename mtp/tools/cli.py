"""What the command-line entry points share: bad input ends a command with one readable line, not a traceback."""

import functools
import sys


def user_errors(main):
    """Wrap a command's `main`: a ValueError, FileNotFoundError or ModuleNotFoundError (bad input, whose message
    names the bad value and the fix) prints `error: <message>` on stderr and exits with status 2."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None

    return run
