"""What the tests and the benches share: process harnesses, tiny jobs and data, device helpers.

Not part of the product: ringtrain never imports it, and the wheel leaves it out
(pyproject.toml). It lives beside the product in platform/, so that whatever puts ringtrain on
the path of a checkout (the editable install of ``make venv`` / ``make venv-test``,
``PYTHONPATH=platform``, the GPU node's PYTHONPATH, pytest's ``pythonpath``) puts it there too,
and every process a test or a bench starts imports the same copy. tests/ and bench/ import it,
never each other (tests/unit/test_layering.py).

- processes: ``try_process`` (a try forked from a preloaded server, or spawned on CUDA),
  ``ranks`` (gloo ranks), ``ray_head`` (a ``ray start --head`` of our own and its processes),
  ``cli_runs`` (``ringtrain`` run as a user runs it, in the foreground or the background),
  ``launched`` (a bench's run in a session of its own, stopped by PID), ``mlflow_server``;
- tiny jobs and data: ``tiny``, ``corpus``, ``prepared_data``, ``chat_data``,
  ``tiny_tokenizer``, ``fake_run``;
- devices: ``emulated_cp`` (a CP group as threads of one process), ``loopback`` (one rank's
  transport looped back on one device), ``timing``, ``live_bytes`` (live tensor storage and its
  peak), ``one_device`` (a model trained on one device: ringtrain's job, transformers' model,
  fp32-master AdamW), ``peak_memory`` (the planner's peak against a measured one);
- benches: ``record`` (what a bench ran on, and its JSON), ``blocks`` (paired timing blocks),
  ``targets`` (a measured value against its bound), ``bench_cli`` (a bench's command line),
  ``ring_targets`` (what the attention benches hold a ring's worst rank to).
"""
