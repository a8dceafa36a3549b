"""The ``symacct`` command run in the test's own process: the exit status, stdout and stderr that
``python -m symacct.cli ARGS`` gives, without the 3-4 s a new interpreter spends importing torch and
symacct (``python -m symacct.cli --help`` took 4.0 s here). Tests that need a real process keep one: a
closed pipe, a full stdout, a hash seed (PYTHONHASHSEED), the README's lines, a factory on PYTHONPATH.

Warnings are shown on the captured stderr under Python's own default filters (pytest records them
otherwise): a warning that would add a line to a real run's stderr adds it here too."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import warnings

from symacct.cli import main


def _show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``symacct ARGS`` as a finished process: returncode, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.resetwarnings()  # Python's defaults (no -W): library code's deprecations not shown
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _show
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse: --help, a usage error
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                err.write(e.code + "\n")
    return subprocess.CompletedProcess(["symacct", *args], rc, out.getvalue(), err.getvalue())
