"""The data feed of a worker: shards in, batches out.

- ``data``: the manifest's view for training, the per-rank shard assignment and epoch order.
- ``shard_reader``: memory-mapped RecordIO shards (random access without holding them in memory).
- ``prefetch``: the background batch builder, batches ready ahead of the step.

May import ``common`` only: no mxnet, so it is testable without a job.
"""
