"""The one exception type for mistakes a user can fix.

The entry points catch it, print its message as a single line and exit with code 2, so a
user never sees a traceback for a bad config, a missing file or impossible degrees.
"""


class UserError(Exception):
    """A problem in the user's input; the message names the key or path and the fix."""
