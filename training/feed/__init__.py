"""The data feed of a worker: shards in, batches out.

Owns: the manifest's view for training and the per-rank shard assignment and epoch order
(``data``), memory-mapped RecordIO shards (``shard_reader``) and the background batch builder
(``prefetch``). May import ``common`` only: no mxnet, so it is testable without a job.
"""
