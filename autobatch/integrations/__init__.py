"""Integrations with the training frameworks people use: one line each.

- :mod:`autobatch.integrations.lightning`: :class:`~autobatch.integrations.lightning.
  AutobatchCallback`, a Lightning callback that finds the batch size before training and
  recovers training batches from out-of-memory errors.
- :mod:`autobatch.integrations.transformers`: :func:`~autobatch.integrations.transformers.
  autobatch_trainer`, which prepares a Hugging Face ``Trainer`` the same way.

Each module imports its framework when it is imported itself; ``import autobatch`` imports
neither.
"""
