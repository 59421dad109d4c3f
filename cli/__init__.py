"""The top floor: the `hsx` command. Nothing below imports it.

    main.py       the parser and main(): COMMANDS registers each floor's subcommands
    args.py       typed configs <-> flags (one flag per dataclass field), --config files, UsageError, exit codes
    jobs.py       run, submit, status, estimate, demo, verify
    training.py   export, train-drafter, eval-drafter
    serve.py      serve
    __main__.py   `python -m cli`
"""
