"""strata.engine: load a pack by byte offset and generate text (``strata-engine generate``).

Flow - the device-neutral modules here, each device in its room:

- :mod:`~strata.engine.startup` - :func:`~strata.engine.startup.load_engine`, the one start-up sequence
  for every device (stages timed by :mod:`~strata.engine.checkpoints`), over the core types of
  :mod:`~strata.engine.core` (``EngineOptions``, ``Engine``, the ``Device`` protocol);
- :mod:`~strata.engine.loader` - every tensor the forward pass reads asserted against geometry.txt
  (name, shape found, shape required) before a weight byte is read;
- :mod:`~strata.engine.recipe` - an architecture's layers as data; :mod:`~strata.engine.models` - one
  file per architecture declaring its recipe; :mod:`~strata.engine.decoder` - the forward pass executed
  from the recipe over an array module ``xp`` (numpy or cupy), with the shared layers of
  :mod:`~strata.engine.layers` (the KV cache: ``--kv f16|f32``, sliding-window layers as ring buffers of
  the budget's size) and :mod:`~strata.engine.deltanet`; :mod:`~strata.engine.numerics` - f32 or
  llama.cpp's CPU activation roundings;
- :mod:`~strata.engine.weights` - the ``Weights`` interface (``get`` / ``matmul`` / ``rows``);
  :mod:`~strata.engine.experts` - routed experts from the shards, the resident set (``ExpertCache``) and
  the hit/miss split (``ExpertPath``); :mod:`~strata.engine.dequant` - gguf-py's dequantizers, bit for
  bit, and ggml's Q1_0 / Q2_0, which gguf-py lacks (:mod:`strata.packer.dequant_own`), chosen by each
  type's registry row (:mod:`strata.packer.quants`); :mod:`~strata.engine.engine_form` - how a weight
  sits in the engine's memory;
- :mod:`~strata.engine.tokenizer` - Hugging Face ``tokenizers`` built from the pack;
  :mod:`~strata.engine.generate` - the decode loop; :mod:`~strata.engine.sampling` - the next token;
- :mod:`~strata.engine.cli` - the click commands (with :mod:`~strata.engine.measure` and
  :mod:`~strata.engine.routing`).

The rooms: :mod:`strata.engine.cpu` - the CPU device (C kernels on the memory-mapped bytes, its weight
store and expert path); :mod:`strata.engine.gpu` - the GPU device (CuPy + CUDA: engine form in VRAM, the
expert cache, the fused step); :mod:`strata.engine.kernel_src` - the per-type kernel sources both devices
compile, and their assembly. The CPU room never imports the GPU's, the shared sources import neither
(tests/test_structure.py).
"""
