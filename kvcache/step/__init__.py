"""One serving step on the device: the scheduled rows become step metadata and a backend
plan, staged in persistent buffers with one host-to-device copy, and replayed in CUDA graphs.

| module | what it holds |
| --- | --- |
| ``builder`` | :class:`MetadataBuilder`: persistent block-table rows, staging, ``plan`` |
| ``buckets`` | :class:`StepBuckets`: the step shapes steps are padded to (decode rows, mixed tokens) |
| ``graphs`` | :class:`StepGraphs`: one CUDA graph per bucket over those buffers |
"""
