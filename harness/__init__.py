"""The test and benchmark harness of the UCM repository: servers, drivers and tools that only
tests and benchmarks use. It is not part of the wheel (``pyproject.toml`` ships ``ucm`` and
``ucm_backends`` only); pytest finds it from the repository root, and ``ucm bench`` finds it in
the checkout that ``ucm`` is installed (editable) from.

- ``harness.s3``: a real S3-compatible server (moto) on 127.0.0.1;
- ``harness.mooncake``: a real ``mooncake_master`` on 127.0.0.1;
- ``harness.soak``: the kill soak, ``python -m harness.soak --seconds 600``.

What plugin authors use (the tier conformance suite) stays in ``ucm.testing``.
"""
