"""User mistakes, reported for people.

A `LabError` is raised for anything the user can fix: a bad mesh spec, a
dimension an axis does not divide, an unknown topology, libtpu missing. Its
message says what was wrong and how to fix it, in one line. The CLI prints it
and exits with code 2; it never shows a traceback for a `LabError`.
"""


class LabError(Exception):
    """A mistake in the user's input; the message names it and the fix."""
