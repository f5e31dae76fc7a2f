"""The `poodle` command line (click + rich). Installed as ``poodle.cli``; thin: it parses options,
shows progress and calls the library."""
