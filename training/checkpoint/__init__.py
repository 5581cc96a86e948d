"""Checkpoints of a training job: what is in one, how it is committed, when one is written.

Owns: the committed-manifest store on S3 or a folder (``store``), client-side envelope
encryption (``crypto``), what a worker puts in a checkpoint and how it is restored
(``state``), the background uploader (``uploader``) and the loop's checkpoint policy (cadence,
skip-while-busy, statistics, emergency save, final commit check: ``manager``). The protocol is in
docs/architecture.md ("Checkpoint protocol"). May import ``common`` only.
"""
