"""What every command-line tool of the package shares: bad input is one line on stderr
(`PROG: error: ...`) and exit status 2, including absl's own flag errors (absl would exit 1
with a multi-line message)."""

import sys

from absl import flags

USAGE_ERROR = 2


def fail(prog: str, message: str, status: int = USAGE_ERROR):
    """Prints `prog: error: message` and exits with `status`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def run(main, prog: str, flag_names) -> None:
    """`absl.app.run(main)` with one-line flag errors, and `--help` listing `flag_names`.

    absl's --help lists the flags of the module sys.argv[0] names: for a console script
    that is the installed wrapper, which defines none, so ours are listed under it too."""
    from absl import app
    for name in flag_names:
        flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])
    app.run(main, flags_parser=flags_parser(prog))


def flags_parser(prog: str):
    """A `flags_parser` for `absl.app.run`: absl's parser, with a bad flag as a usage error."""

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(prog, f"{e} (see --help)")

    return parse
