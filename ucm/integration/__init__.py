"""Engine integrations: thin modules over the public Store API, one per engine.

- ``ucm.integration.vllm``: ``UcmConnector``, a vLLM v1 KV connector;
- ``ucm.integration.lmcache``: ``UcmStorageBackend``, an LMCache storage plugin;
- ``ucm.integration.sglang``: ``UcmHiCacheStorage``, an SGLang HiCache L3 storage backend.

They share :mod:`ucm.integration.keys` (block ids salted with everything that makes KV
incompatible, and stacks whose geometry comes from the engine) instead of each deriving keys on
its own. SGLang's and LMCache's gets share :mod:`ucm.integration.bounded` (a load that returns
by its deadline and never writes the engine's memory afterwards). Importing this package imports
no engine and no torch.
"""
