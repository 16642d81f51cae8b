"""The one exception type for mistakes a user can fix.

The entry points catch it, print its message as a single line and exit with code 2, so a
user never sees a traceback for a bad config, a missing file or impossible degrees.
"""

import sys
from typing import Callable


class UserError(Exception):
    """A problem in the user's input; the message names the key or path and the fix."""


def sentence(error: UserError) -> str:
    """The error's one sentence. torch's DataLoader raises a worker's UserError again in this process with the
    worker's traceback as its message ("Caught UserError in DataLoader worker process N.\\nOriginal Traceback ...
    titanlite.errors.UserError: <sentence>"): the sentence is that traceback's last line."""
    text = str(error)
    if not text.startswith("Caught UserError "):
        return text
    return text.strip().splitlines()[-1].split("UserError: ", 1)[-1]


def exit_code(command: Callable[..., None], *args) -> int:
    """A command-line entry point's exit code: 0, or 2 after printing a UserError as its one line."""
    try:
        command(*args)
    except UserError as error:
        print(f"error: {sentence(error)}", file=sys.stderr)
        return 2
    return 0
