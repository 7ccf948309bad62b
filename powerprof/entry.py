"""The `powerprof` command's first code: for `tune` only, SIGUSR1 is recorded from here on, before the CLI is imported.

SIGUSR1 is the tuner's kill switch, and its default action ends the process. Importing the CLI
(click and the rest) takes most of a second, and a kill switch sent then ended the tuner, which
systemd restarted tuning: the kill was lost. This module imports nothing but `signal` and `sys`,
so what is left is the interpreter's own start-up (the unit's `RestartPreventExitStatus=SIGUSR1`
covers that). `tune`'s KillSwitch takes SIGUSR1 over and reads `caught` from the handler it
replaces (runner.KillSwitch.install). Every other command, and `import powerprof`, is untouched.
"""

import signal
import sys


class EarlySigusr1:
    """Counts SIGUSR1s until the KillSwitch replaces it and takes them on."""

    def __init__(self):
        self.caught = 0

    def __call__(self, *_):
        self.caught += 1


def main():
    if sys.argv[1:2] == ["tune"]:  # the group's own options (--help, --version) never precede a subcommand that runs
        signal.signal(signal.SIGUSR1, EarlySigusr1())
    from powerprof.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
