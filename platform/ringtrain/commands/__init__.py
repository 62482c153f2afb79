"""The verbs of the `ringtrain` command line, one module each: ``ringtrain X`` is ``commands/X.py``.

``jobs`` holds the four verbs of a job on a running cluster (submit, status, logs, stop), and
``eval_source`` what ``eval``'s SOURCE names. ``ringtrain.cli`` builds the parser from these
modules and dispatches; importing this package imports none of them.
"""
