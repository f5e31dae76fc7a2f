"""Runs several `poodle` commands in one process, so one torchrun launch covers several stages
(each launch costs seconds). Argument: a JSON list of argument lists."""

import json
import sys

from poodle.cli.main import cli

for args in json.loads(sys.argv[1]):
    try:
        cli.main(args, prog_name="poodle", standalone_mode=False)
    except SystemExit as e:  # friendly_errors exits 1 after printing the error
        if e.code:
            raise
