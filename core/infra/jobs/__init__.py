"""One batch-job runner for the batch CLIs (``pathology.batch``, ``video.batch``): items, shards, locks that hold
across hosts, atomic writes, a manifest, a per-item time limit and a settings fingerprint on every output.

A job is an object with four methods (see :class:`Job`): the output files of an item (the last one is the item's
final output), the settings each output must have been made with, the settings stored in an existing output,
and ``process(item)``, which writes the outputs (atomically, with their settings) and returns manifest fields.
:func:`run_job` does the rest:

- **shards**: ``shard=(I, N)`` takes items ``I, I+N, ...`` of the list (keys must be unique over the whole list);
- **skip what is done**: an item whose final output exists with the same settings is not redone;
- **settings fingerprint**: an existing output made with other settings (or with no record of them) is never
  reused silently: by default the run refuses before any work, naming the differing settings
  (:class:`SettingsMismatch`); with ``overwrite=True`` those outputs are redone;
- **locks**: ``OUT/locks/<key>.lock``, created atomically (hard link of a complete temp file, ``O_CREAT|O_EXCL``
  where links are not supported) and holding host, pid, start time and a heartbeat refreshed by a thread while
  the item runs. A lock is stale when its process is gone (same host) or its heartbeat is older than
  ``stale_after`` seconds (any host), and is then broken by an atomic rename, so two takers cannot both win;
- **temp files**: outputs are written to ``.<name>.*.tmp*`` beside them and renamed; whoever holds an item's lock
  removes leftover temps of that item's outputs (their writer was killed, on any host);
- **time limit**: with ``time_limit`` set, items run one at a time in a worker process (start method ``spawn``,
  its own process group); an item past the limit has the whole group killed (a stuck decoder included), is
  recorded as failed, and the next item gets a fresh worker;
- **manifest**: ``OUT/manifest.csv`` (``manifest_<I>of<N>.csv`` per shard), one row per item: status (``done``,
  ``empty``, ``exists`` — found finished —, ``failed``, ``locked``), final output, settings
  fingerprint, seconds, host, error. Each write merges into the file under a short lock, so workers sharing a
  shard do not erase each other's rows. Tracebacks go to ``OUT/failures.log``;
- **failures**: a failed item (exception or time limit) is recorded; the run stops unless ``skip_errors``.

The package: :mod:`~core.infra.jobs.runner` (items, the job protocol, configuration, manifest, worker processes,
:func:`run_job`), :mod:`~core.infra.jobs.files` (atomic writes and the cross-host lock),
:mod:`~core.infra.jobs.settings` (fingerprints) and :mod:`~core.infra.jobs.cli` (the shared CLI options).
"""

from core.infra.jobs.cli import add_job_arguments, batch_parser, job_config_from_args, parse_shard
from core.infra.jobs.files import FileLock, atomic_target, atomic_write, remove_temps
from core.infra.jobs.runner import Item, ItemTimeout, Job, JobConfig, SettingsMismatch, manifest_path, run_job
from core.infra.jobs.settings import canonical_settings, file_identity, settings_diff, settings_fingerprint

__all__ = ["Item", "Job", "JobConfig", "SettingsMismatch", "ItemTimeout", "FileLock", "run_job", "canonical_settings",
           "settings_fingerprint", "settings_diff", "file_identity", "atomic_target", "atomic_write", "remove_temps",
           "parse_shard", "manifest_path", "batch_parser", "add_job_arguments", "job_config_from_args"]
