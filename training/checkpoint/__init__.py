"""Checkpoints of a training job: what is in one, how it is committed, when one is written.

- ``store``: the committed-manifest store on S3 or a folder; a committed checkpoint never changes.
- ``crypto``: client-side envelope encryption of checkpoint files (AES-256-GCM).
- ``state``: what a worker puts in a checkpoint (parameters, optimizer state, RNG) and restores.
- ``uploader``: ``CheckpointUploader``, which writes snapshots in a background thread, one in flight.
- ``manager``: ``CheckpointManager``, the loop's checkpoint policy: when to save, skip-while-busy,
  statistics, emergency save, final commit check.
- ``cadence``: the ``every_n_steps: "auto"`` interval (Young/Daly) from measured costs.

The protocol is in docs/architecture.md ("Checkpoint protocol"). May import ``common`` only.
"""
