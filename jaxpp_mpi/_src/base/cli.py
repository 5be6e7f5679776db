"""`python -m jaxpp_mpi._src.base.cli --table | --update [DOC]`: the table of every
`JAXPP_MPI_*` variable, generated from base/variables.py, printed or written into DOC
(default docs/reliability.md, whose table tests/unit/test_variables.py compares)."""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from jaxpp_mpi._src.base.variables import markdown_table, update_table


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the variables' table (`--table`) or rewrites DOC's (`--update [DOC]`).

    Args:
      argv: the options (default `sys.argv[1:]`).

    Returns:
      0.
    """
    parser = argparse.ArgumentParser(prog="python -m jaxpp_mpi._src.base.cli",
                                     description="The JAXPP_MPI_* variables' table.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--table", action="store_true", help="print the markdown table")
    group.add_argument("--update", nargs="?", const="docs/reliability.md", metavar="DOC",
                       help="rewrite DOC's table (default docs/reliability.md)")
    args = parser.parse_args(argv)
    if args.table:
        sys.stdout.write(markdown_table())
    else:
        doc = pathlib.Path(args.update)
        doc.write_text(update_table(doc.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
