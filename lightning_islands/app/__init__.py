"""The application around the library: what the ``lightning-islands`` command runs.

- :mod:`~lightning_islands.app.cli`: the ``lightning-islands`` command (``train``, ``run``,
  ``coordinator``, ``report``);
- :mod:`~lightning_islands.app.launch`: the launcher, which starts a coordinator and each island as
  a ``torch.distributed.run`` subprocess on this machine;
- :mod:`~lightning_islands.app.worker`: the entry point of one training process of one island
  (``python -m lightning_islands.app.worker JOB.yaml``), which turns the job into a Trainer;
- :mod:`~lightning_islands.app.train`: the Hydra driver (``lightning-islands train``), which composes
  the config, launches the islands and prints the summary;
- :mod:`~lightning_islands.app.report` and :mod:`~lightning_islands.app.summary`: the table and plots
  of a folder of finished runs, and the end-of-run summary of one.

The library (strategies, outer optimizer, codecs, transport, models, data) does not import this
package; importing it imports none of its modules, so each command loads only what it needs.
"""
